"""FP8 at run time: the TransformerConfig FP8 fields are Megatron-LM's for the same flags (field
by field), the plan's per-layer bf16 choice reaches megatron-core's per-layer FP8 switch, and
without Transformer Engine or an FP8 GPU the run stops in one line before any process group
(this machine has neither, so that refusal is what runs here)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import PlanError
from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
from megatron_ext.megatron_adapter.fp8 import check_fp8_runtime, install_layer_precision
from megatron_ext.megatron_adapter.sp_norm import have_transformer_engine
from megatron_ext.megatron_adapter.transformer_config import transformer_config

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--vocab-size", "1024", "--bf16", "--use-distributed-optimizer",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
FP8_FIELDS = (  # docs: reference fp8.md section 1, transformer_config.py:429-527 at 0.16.1
    "fp8", "fp8_recipe", "fp8_param", "fp8_quantizer_factory", "fp8_margin", "fp8_interval",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention",
    "fp8_multi_head_attention", "tp_only_amax_red", "first_last_layers_bf16",
    "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp4", "fp4_recipe",
    "fp4_param", "fp4_quantizer_factory",
)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}


def megatron_lm_fields(ns) -> dict:
    """What Megatron-LM's core_transformer_config_from_args (arguments.py:1306-1331) puts in
    the FP8 fields: each args attribute named like the field, then
    fp8_param = args.fp8_param_gather; fields without a flag keep the dataclass default."""
    out = {name: getattr(ns, name) if hasattr(ns, name) else DEFAULTS[name]
           for name in FP8_FIELDS}
    out["fp8_param"] = ns.fp8_param_gather
    # 0.19 renamed --fp4-param-gather's dest fp4_param -> fp4_param_gather and copies it in, as
    # fp8_param (the fp4 flags themselves are refused here, flags/catalog.py)
    out["fp4_param"] = getattr(ns, "fp4_param", getattr(ns, "fp4_param_gather",
                                                        DEFAULTS["fp4_param"]))
    return out


@pytest.mark.parametrize("flags", [
    [],
    ["--fp8-format", "hybrid"],
    ["--fp8-format", "e4m3", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
     "max", "--fp8-margin", "2", "--no-fp8-wgrad", "--fp8-param-gather"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
     "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "3"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-param-gather"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
])
def test_fp8_config_fields_match_megatron_lm(flags):
    ns = parse_megatron_args(BASE + flags, world_size=8)
    for name in FP8_FIELDS:  # the flag-backed fields are read from the namespace, not defaulted
        if name not in ("fp8_dot_product_attention", "fp8_multi_head_attention",
                        "tp_only_amax_red", "fp8_param", "fp4_param"):
            assert hasattr(ns, name), name
    plan = plan_from_megatron_args(ns, 8)
    config = transformer_config(plan.model, precision=plan.precision, strategy=plan.layers[0],
                                pp=plan.pp, fp8=plan.fp8)
    assert {name: getattr(config, name) for name in FP8_FIELDS} == megatron_lm_fields(ns)


def test_per_layer_bf16_override_reaches_megatron_core():
    from megatron.core import fp8_utils

    ns = parse_megatron_args(BASE + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                                     "--first-last-layers-bf16"], world_size=8)
    plan = plan_from_megatron_args(ns, 8)
    config = transformer_config(plan.model, strategy=plan.layers[0], pp=plan.pp, fp8=plan.fp8)
    stock = [fp8_utils.is_first_last_bf16_layer(config, i) for i in range(8)]
    assert stock == [not plan.fp8.layer_in_fp8(i, 8) for i in range(8)]  # Megatron's window
    original = fp8_utils.is_first_last_bf16_layer
    fp8 = dataclasses.replace(plan.fp8, bf16_layers=(3, 4))
    try:
        install_layer_precision(fp8)
        ours = [fp8_utils.is_first_last_bf16_layer(config, i) for i in range(8)]
        assert ours == [True, False, False, True, True, False, False, True]
        assert not fp8_utils.is_first_last_bf16_layer(config, -1)  # whole-block context
    finally:
        fp8_utils.is_first_last_bf16_layer = original


def test_no_fp8_hardware_is_one_line():
    with pytest.raises(PlanError) as err:
        check_fp8_runtime("hybrid", "delayed", cpu=True)
    assert "FP8 training needs an NVIDIA GPU" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PlanError, match="--transformer-impl local"):
        check_fp8_runtime("hybrid", "delayed", cpu=False, transformer_impl="local")
    check_fp8_runtime(None, "delayed", cpu=True)  # no FP8, nothing to check
    if have_transformer_engine():
        pytest.skip("Transformer Engine is installed here; the no-TE refusal cannot run")
    with pytest.raises(PlanError) as err:
        check_fp8_runtime("hybrid", "tensorwise", cpu=False)
    assert "Transformer Engine, which is not installed" in str(err.value)


@pytest.mark.parametrize("cpu", [True, False])
def test_pretrain_refuses_fp8_before_any_process_group(tmp_path, cpu):
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "128", "--bf16", "--fp8-format", "hybrid"]
    flags += ["--cpu"] if cpu else []
    code = ("import sys\nimport torch.distributed as dist\n"
            "from megatron_ext.megatron_adapter.training.entry import main\n"
            f"code = main({flags!r})\n"
            "assert not dist.is_initialized(), 'a process group was created'\n"
            "sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=False, cwd=tmp_path,
                            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)})
    if not cpu and have_transformer_engine():
        pytest.skip("Transformer Engine is installed here")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    expected = "FP8 training needs an NVIDIA GPU" if cpu else "no CUDA device is visible"
    assert expected in result.stderr, result.stderr
