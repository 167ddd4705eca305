"""Which megatron-core versions the runtime supports, and how they differ where this package cares.

`SUPPORTED_RANGE` is the one statement of the range (setup.py's `train` extra repeats it as a
requirement: a test keeps the two equal). `check_megatron_core()` is called by the runtime's
entry points (pretrain_gpt.py's main, `megatron-ext profile`) before torch.distributed starts:
outside the range, or with no megatron-core installed, the run stops with one line naming the
installed version and the range. The version is read from the installed distribution's metadata,
so this module imports neither torch nor megatron and the check costs no megatron-core import.

`DIFFERENCES` is the table of what changed between the supported versions in the megatron-core
API this package uses (from the 0.16.1 and 0.19.2 wheels: `file.py:line` are relative to
`megatron/core/`): feature -> how 0.16.1 does it -> how 0.19.x does it -> what megatron_ext
does. The code that bridges each row lives in one module, `megatron_adapter/compat.py` (it
imports megatron-core; this one does not); the rest of the package calls it and never tests a
version itself. CPU patches carry their own version ranges (`cpu/patches.py`, `patches/README.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.errors import PlanError
from megatron_ext.flags.versions import installed_megatron_core, parse_version

OLDEST = (0, 16, 1)  # first supported version
# 0.16.1 (Python 3.11 CI leg) and 0.19.x (Python 3.12 leg) are tested; 0.17 and 0.18 sit between
# them and take the 0.19 code paths wherever their API already has the 0.19 shape (compat.py
# detects each feature, not the version number).
FIRST_UNSUPPORTED = (0, 20, 0)  # first version not yet supported
SUPPORTED_RANGE = ">=0.16.1,<0.20"

__all__ = ["SUPPORTED_RANGE", "check_megatron_core", "check_version_features",
           "installed_megatron_core", "is_supported", "parse_version", "version_at_least",
           "DIFFERENCES"]


def is_supported(version: str) -> bool:
    return OLDEST <= parse_version(version) < FIRST_UNSUPPORTED


def check_megatron_core(version: str | None = None) -> str:
    """The installed (or given) megatron-core version if supported; else a one-line PlanError."""
    version = installed_megatron_core() if version is None else version
    install = f"pip install 'megatron_ext[train]' (megatron-core{SUPPORTED_RANGE})"
    if version is None:
        raise PlanError(f"megatron-core is not installed; the training runtime needs it: {install}")
    try:
        supported = is_supported(version)
    except ValueError:
        supported = False
    if not supported:
        raise PlanError(f"megatron-core {version} is installed; megatron_ext's runtime supports "
                        f"megatron-core{SUPPORTED_RANGE}: {install}")
    return version


def version_at_least(version: str, minimum: tuple[int, int, int]) -> bool:
    return parse_version(version) >= minimum


NOT_YET_ON_0_19: tuple[tuple[str, str, str], ...] = ()
"""Features whose parity is verified on megatron-core 0.16.1 and not yet on 0.17+ (the `open:`
rows of DIFFERENCES), as (args dest, flag, why): refused there in one line rather than run
unverified. None at present."""


def check_version_features(args: object, version: str | None = None) -> None:
    """One-line PlanError when the parsed Megatron-LM flags ask for a feature this package has
    not verified on the installed megatron-core (NOT_YET_ON_0_19); nothing otherwise."""
    version = installed_megatron_core() if version is None else version
    if version is None or not version_at_least(version, (0, 17, 0)):
        return
    for dest, flag, why in NOT_YET_ON_0_19:
        if getattr(args, dest, None):
            raise PlanError(f"{flag}: not supported with megatron-core {version} yet ({why}; "
                            "docs/megatron-versions.md); use megatron-core 0.16.1 on Python "
                            "3.11 for this model")


@dataclass(frozen=True, kw_only=True, slots=True)
class VersionDifference:
    """One megatron-core API this package uses that is not the same in every supported version."""

    feature: str
    """What the package needs, in its words."""
    v0_16: str
    """How megatron-core 0.16.1 provides it."""
    v0_19: str
    """How megatron-core 0.19.x provides it."""
    here: str
    """What megatron_ext does about it (where the code lives, or what is still to do)."""


DIFFERENCES: tuple[VersionDifference, ...] = (
    VersionDifference(
        feature="Python",
        v0_16="wheels for 3.10-3.12 (the CI leg: 3.11)",
        v0_19="wheels for Python 3.12 only (datasets/helpers_cpp is cp312)",
        here="planner on any Python >= 3.10; the 0.19 runtime needs Python 3.12"),
    VersionDifference(
        feature="import megatron.core.pipeline_parallel.schedules / models.gpt",
        v0_16="no triton import",
        v0_19="imports triton unguarded via transformer/moe/ops/paged_stash.py:4 (CUDA torch "
              "wheels bring triton, +cpu ones do not)",
        here="install triton (CUDA torch wheels do), or stub the paged_stash ops module on CPU"),
    VersionDifference(
        feature="context-parallel batch split (losses.py)",
        v0_16="utils.get_batch_on_this_cp_rank(batch, cp_group=None)",
        v0_19="utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None, ...): "
              "is_hybrid_cp required",
        here="compat.cp_batch passes is_hybrid_cp=False where the parameter exists"),
    VersionDifference(
        feature="one pipeline backward step (vocab/iteration.py)",
        v0_16="schedules.backward_step(input, output, output_grad, model_type, config)",
        v0_19="schedules.backward_step(input, output, output_grad, config)",
        here="compat.backward_step passes model_type only where the parameter exists"),
    VersionDifference(
        feature="async checkpoint writer's results queue (training/checkpoint.py)",
        v0_16="filesystem_async._get_write_results_queue()",
        v0_19="filesystem_async.get_write_results_queue(mp_mode='spawn')",
        here="compat.write_results_queue calls whichever name exists"),
    VersionDifference(
        feature="batch-size ramp-up (training/rampup.py)",
        v0_16="num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator",
        v0_19="removed; StepBatchsizeNumMicroBatchesCalculator ('THRESHOLD:BS ...') instead",
        here="training/rampup.py computes the 0.16.1 linear ramp itself on every version "
             "(equal to 0.16.1's calculator: tests/unit/test_run_config.py)"),
    VersionDifference(
        feature="gradients for the grad norm (optimizer.py)",
        v0_16="MegatronOptimizer.get_main_grads_for_grad_norm()",
        v0_19="MegatronOptimizer.get_grads_for_grad_norm(grad_norm_group=None)",
        here="compat.grads_for_grad_norm calls whichever exists"),
    VersionDifference(
        feature="NullTokenizer (--tokenizer-type NullTokenizer --vocab-size N)",
        v0_16="tokenizers library 'null': end-of-document id N, vocabulary N + 1",
        v0_19="tokenizers library 'null-text' (text_libraries): end-of-document id N - 1, "
              "vocabulary N",
        here="compat.null_tokenizer builds the installed version's NullTokenizer, so --vocab-size "
             "means what it means to that version's Megatron"),
    VersionDifference(
        feature="MoE auxiliary-loss logging (moe_logging.py)",
        v0_16="moe_utils.clear_aux_losses_tracker / get_moe_layer_wise_logging_tracker",
        v0_19="deprecated shims over transformer/moe/moe_logging.py MoEMetricsTracker "
              "(get_moe_metrics_tracker())",
        here="compat.moe_metric_values / clear_moe_metrics use the tracker where "
             "transformer/moe/moe_logging.py exists, the moe_utils dict otherwise"),
    VersionDifference(
        feature="DDP gradient sync on CPU (cpu/patches.py cuda_streams)",
        v0_16="torch.cuda.current_stream() only with several distributed-optimizer instances",
        v0_19="torch.cuda.current_stream() + wait_event in every start_grad_sync "
              "(distributed/param_and_grad_buffer.py:632)",
        here="the runtime patch covers it (_DummyStream.wait_event too); the source diff is "
             "per version (patches/README.md)"),
    VersionDifference(
        feature="TE GEMM when transformer-engine is absent (cpu patch te_gemm_stub)",
        v0_16="moe_utils imports te_general_gemm unguarded",
        v0_19="moe_utils binds te_general_gemm = None without TE (fixed upstream)",
        here="the patch applies to 0.16.x only (cpu/patches.py versions)"),
    VersionDifference(
        feature="renamed / removed config fields",
        v0_16="TransformerConfig.moe_use_legacy_grouped_gemm, ModelParallelConfig."
              "moe_extended_tp / async_tensor_model_parallel_allreduce, DDP config "
              "preserve_fp32_weights, OptimizerConfig.muon_use_nesterov",
        v0_19="removed; muon_use_nesterov renamed muon_nesterov",
        here="the package sets none of them; the flags that carried them are in flags/versions.py "
             "RENAMED)"),
    VersionDifference(
        feature="dist-checkpoint common state",
        v0_16="a separate common.pt beside the torch_dist shards",
        v0_19="inside the torch_dist checkpoint; common.pt is the legacy layout "
              "(serialization.py:149-223, load_common reads both)",
        here="compat.load_common_state (checkpoint inspect/export-hf) reads either; the file "
             "check (checkpoint_files.find_damage) takes a `.metadata` naming common_state in "
             "place of common.pt; resume reads it with load_common_state_dict on both"),
    VersionDifference(
        feature="MoE layers in the layerwise runtime",
        v0_16="parity with single-process megatron-core (tests/dist/test_moe_parity.py)",
        v0_19="same tests; with per-token loss the router now weighs a rank's aux and z-loss "
              "by its tokens x the tp_cp group size (router.py:604-636)",
        here="compat.router_weighs_the_token_block: layers.py leaves that factor to the router "
             "on 0.19 (it multiplied the coefficients by the token block itself on 0.16)"),
    VersionDifference(
        feature="MLA query/key norms (local spec)",
        v0_16="q_layernorm built only with a query latent (multi_latent_attention.py:497)",
        v0_19="transformer/mla_qk_norm_config.py:132-167: with --qk-layernorm and no "
              "q_lora_rank the query is normalised too, through a fused norm+linear "
              "linear_q_proj (column_parallel_layer_norm_linear: Transformer Engine only); a "
              "separate q norm without q_lora_rank is rejected",
        here="mla_attention.py drops the unused q norm (both versions); where megatron-core "
             "normalises the query (compat.mla_normalises_query) the local spec's linear_q_proj "
             "is norm_linear.LocalLayerNormColumnParallelLinear (TE's parameter names), given "
             "to the resolver by compat.mla_qk_norm_classes: the model is each version's own "
             "(tests/dist/test_mla_parity.py on both); the cost model leaves out 0.19's "
             "hidden-sized query norm"),
    VersionDifference(
        feature="Megatron-LM command-line flags",
        v0_16="flags/megatron_lm_core_v0.16.1_flags.json",
        v0_19="flags/megatron_lm_core_v0.19.0_flags.json (core_v0.19.0 = core_r0.19.0)",
        here="`megatron-ext args --megatron-version` emits only the chosen version's flags"),
)
