"""Every Megatron-LM flag, in exactly one class: honoured, no effect here, refused.

`megatron_lm_core_v0.16.1_flags.json` (next to this file) lists every option string of
Megatron-LM core_v0.16.1 `megatron/training/arguments.py` with its argparse dest, nargs, const,
default and type; `megatron_lm_core_v0.19.0_flags.json` the same for core_v0.19.0 (both made by
tools/gen_flag_catalog.py; flags/versions.py picks one per megatron-core version). This module
gives each of them one class:

- honoured: same name, meaning and default as Megatron-LM; parser.py defines it.
- no effect: accepted, logged once at start with the reason (logging, profiling, debugging,
  checkpoint-engine and kernel switches that do not change the model, the maths or the plan, and
  flags Megatron-LM's own pretrain_gpt.py does not read).
- refused: a one-line error naming the unsupported feature and what to use instead. A refused
  flag given with Megatron-LM's default value (`--expert-model-parallel-size 1`) changes nothing
  and passes.

The rules below name core_v0.16.1's options; a flag only a newer catalog has and no rule names
is refused unless given its default ("this core_v0.19.0 feature is not supported"), so nothing
new is accepted and ignored before someone has classified it.

`pretrain_gpt.py`, `plan-from-args` and `megatron-ext args` all read this table, through
parser.py. A string not in the file is "not a Megatron flag". Nothing here imports torch or
megatron.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from megatron_ext.errors import PlanError
from megatron_ext.flags.versions import BASE, CATALOGS, FlagCatalogVersion

FLAGS_FILE = BASE.file

Kind = Literal["honoured", "no_effect", "refused"]


@dataclass(frozen=True)
class MegatronFlag:
    """One option string of Megatron-LM's parser, as the flags file records it."""

    option: str
    dest: str
    nargs: int | str | None
    default: str  # repr() text of Megatron-LM's default
    type: str

    def default_value(self) -> Any:
        """Megatron-LM's default as a Python value; its text where it is not a literal."""
        try:
            return ast.literal_eval(self.default)
        except (ValueError, SyntaxError):
            return self.default


@dataclass(frozen=True)
class Entry:
    flag: MegatronFlag
    kind: Kind
    reason: str = ""  # no_effect: why; refused: the unsupported feature
    instead: str = ""  # refused: what to use instead

    def refusal(self, value: Any = None) -> str:
        shown = "" if value is None or value is True else f" {_show(value)}"
        return (f"{self.flag.option}{shown}: {self.reason} is not supported by megatron_ext; "
                f"{self.instead}")

    def note(self) -> str:
        return f"{self.flag.option} has no effect here: {self.reason}"


@cache
def megatron_flags(version: FlagCatalogVersion = BASE) -> dict[str, MegatronFlag]:
    """Every option of `version`'s catalog (default core_v0.16.1's)."""
    data = json.loads(version.file.read_text())["flags"]
    flags = {}
    for option, spec in data.items():
        nargs = spec["nargs"]
        if isinstance(nargs, str) and nargs.isdigit():
            nargs = int(nargs)
        flags[option] = MegatronFlag(option, spec["dest"], nargs, spec["default"], spec["type"])
    return flags


# ---------------------------------------------------------------------------------------------
# The classes. Explicit options first, then prefix families; the first match wins. Options that
# parser.py defines and no rule below names are honoured (a test checks both directions).
# ---------------------------------------------------------------------------------------------

_NO_PRETRAIN = "Megatron-LM's pretrain_gpt.py does not read it either"

# (options, reason) -- accepted, logged once.
NO_EFFECT: tuple[tuple[tuple[str, ...], str], ...] = (
    (("-h", "--help"), "argparse help"),
    (("--log-progress", "--timing-log-option", "--no-log-loss-scale-to-tensorboard",
      "--disable-log-loss-scale-to-tensorboard", "--log-memory-interval",
      "--log-device-memory-used", "--log-num-zeros-in-grad", "--log-max-attention-logit",
      "--no-barrier-with-level-1-timing", "--log-world-size-to-tensorboard",
      "--log-energy", "--config-logger-dir", "--app-tag-run-name", "--app-tag-run-version",
      "--no-one-logger", "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
      "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity",
      "--log-straggler", "--straggler-ctrlr-port", "--straggler-minmax-count",
      "--disable-straggler-on-startup", "--run-workload-inspector-server"),
     "a logging / monitoring switch; megatron_ext logs loss, timings and throughput its own way"),
    (("--profile", "--profile-step-start", "--profile-step-end", "--use-pytorch-profiler",
      "--profile-ranks", "--record-memory-history", "--memory-snapshot-path"),
     "a profiler switch; profile with `megatron-ext profile` or torch.profiler around "
     "pretrain_gpt.py"),
    (("--deterministic-mode", "--rerun-mode", "--error-injection-rate", "--error-injection-type",
      "--check-for-spiky-loss", "--check-for-large-grads", "--result-rejected-tracker-filename",
      "--check-weight-hash-across-dp-replicas-interval", "--train-sync-interval",
      "--batch-invariant-mode", "--dump-param-to-param-group-map"),
     "a debugging / result-validation switch of Megatron-LM's training loop; it does not change "
     "the model or the maths"),
    (("--exit-signal-handler-for-dataloader", "--manual-gc", "--manual-gc-interval",
      "--no-manual-gc-eval", "--disable-manual-gc-eval",
      "--adlr-autoresume", "--adlr-autoresume-interval", "--enable-ft-package",
      "--calc-ft-timeouts", "--ft-num-warmup-iters", "--inprocess-restart",
      "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
      "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
      "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
      "--inprocess-heartbeat-timeout", "--inprocess-barrier-timeout",
      "--inprocess-completion-timeout", "--inprocess-last-call-wait",
      "--inprocess-termination-grace-time", "--inprocess-granularity",
      "--inprocess-active-world-size", "--inprocess-empty-cuda-cache"),
     "a process-management switch (signals, garbage collection, cluster auto-resume, fault "
     "tolerance); resume a stopped run with --load"),
    (("--ckpt-fully-parallel-load", "--no-ckpt-fully-parallel-save",
      "--disable-ckpt-fully-parallel-save", "--ckpt-fully-parallel-save",
      "--dist-ckpt-strictness", "--dist-ckpt-save-pre-mcore-014",
      "--distrib-optim-fully-reshardable-mem-efficient", "--no-strict-fsdp-dtensor-load",
      "--disable-strict-fsdp-dtensor-load", "--auto-detect-ckpt-format", "--use-dist-ckpt",
      "--dist-ckpt-format", "--replication", "--replication-jump", "--replication-factor",
      "--no-use-tokenizer-model-from-checkpoint-args",
      "--disable-use-tokenizer-model-from-checkpoint-args", "--disable-msc"),
     "a checkpoint-engine switch; megatron_ext saves and loads torch_dist checkpoints with "
     "megatron-core's dist_checkpointing and its own resharding rules"),
    (("--disable-async-tensor-model-parallel-allreduce", "--no-clone-scatter-output-in-embedding",
      "--disable-clone-scatter-output-in-embedding", "--disable-jit-fuser",
      "--no-gradient-reduce-div-fusion", "--no-scatter-gather-tensors-in-pipeline",
      "--use-te-activation-func", "--te-rng-tracker", "--inference-rng-tracker",
      "--disable-bf16-reduced-precision-matmul", "--init-model-with-meta-device", "--onnx-safe",
      "--enable-experimental", "--keep-fp8-transpose-cache", "--use-fused-weighted-squared-relu",
      "--high-priority-stream-groups", "--symmetric-ar-type",
      "--pipeline-model-parallel-comm-backend", "--use-ring-exchange-p2p",
      "--disable-gloo-process-groups", "--distributed-timeout-seconds-after-init",
      "--use-nccl-ub", "--disable-symmetric-registration", "--fsdp-manual-registration",
      "--use-sharp", "--sharp-enabled-group", "--create-all-gather-group",
      "--nccl-communicator-config-path", "--fsdp-double-buffer",
      "--suggested-communication-unit-size", "--no-align-grad-reduce", "--no-align-param-gather",
      "--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw", "--delay-wgrad-compute",
      "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit",
      "--overlap-p2p-communication-warmup-flush", "--enable-cuda-graph",
      "--cuda-graph-warmup-steps", "--external-cuda-graph", "--cuda-graph-impl",
      "--cuda-graph-scope", "--dataloader-fast-cache-load", "--dataloader-defer-npy-index-mmap",
      "--no-pin-cpu-grads", "--no-pin-cpu-params", "--tokenizer-hf-use-fast",
      "--trust-remote-code", "--padded-vocab-size"),
     "a kernel / communication / caching implementation switch; it changes speed, not the model, "
     "the maths or the plan (--padded-vocab-size: Megatron-LM recomputes it from the tokenizer)"),
    (("--log-memory-to-tensorboard", "--log-params-norm", "--log-throughput",
      "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
      "--tensorboard-log-interval", "--tensorboard-queue-size", "--timing-log-level"),
     "a logging switch megatron_ext's loop does not implement; its log line has loss, grad "
     "norm, timings and tokens/s"),
    (("--attention-backend", "--use-flash-attn", "--cross-entropy-loss-fusion",
      "--cross-entropy-fusion-impl", "--no-persist-layer-norm",
      "--empty-unused-memory-level", "--num-dataset-builder-threads",
      "--no-create-attention-mask-in-dataloader"),
     "a kernel / memory / loader implementation switch; the attention, loss and norms compute "
     "the same result without it"),
    (("--no-async-tensor-model-parallel-allreduce", "--use-mcore-models"),
     "deprecated; Megatron-LM ignores it too"),
    (("--distributed-backend",), "the backend follows the device: nccl on GPUs, gloo with --cpu"),
    (("--dist-ckpt-optim-fully-reshardable",),
     "megatron_ext's optimizer checkpoints reshard across plans without it"),
    (("--bert-no-binary-head", "--ict-head-size", "--biencoder-projection-dim",
      "--biencoder-shared-query-context-model", "--ict-load", "--bert-load", "--titles-data-path",
      "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path",
      "--retriever-report-topk-accuracies", "--retriever-score-scaling", "--block-data-path",
      "--embedding-path", "--indexer-batch-size", "--indexer-log-interval", "--num-classes",
      "--img-h", "--img-w", "--num-channels", "--patch-dim", "--classes-fraction",
      "--data-per-class-fraction", "--no-data-sharding", "--head-lr-mult", "--vision-pretraining",
      "--vision-pretraining-type", "--vision-backbone-type", "--swin-backbone-type",
      "--mask-type", "--mask-factor", "--iter-per-epoch", "--output-bert-embeddings",
      "--bert-embedder-type", "--sample-rate", "--mask-prob", "--short-seq-prob",
      "--relative-attention-num-buckets", "--relative-attention-max-distance",
      "--tiktoken-pattern", "--tiktoken-num-special-tokens", "--tiktoken-special-tokens",
      "--tokenizer-sentencepiece-legacy", "--legacy-tokenizer", "--muon-momentum",
      "--muon-no-split-qkv", "--muon-use-nesterov", "--muon-scale-mode", "--muon-fp32-matmul-prec",
      "--muon-num-ns-steps", "--muon-tp-mode", "--muon-extra-scale-factor",
      "--optimizer-offload-fraction", "--use-torch-optimizer-for-cpu-offload",
      "--overlap-cpu-optimizer-d2h-h2d", "--mamba-state-dim", "--mamba-head-dim",
      "--mamba-num-groups", "--mamba-num-heads", "--disable-mamba-mem-eff-path",
      "--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-value-head-dim",
      "--linear-num-key-heads", "--linear-num-value-heads", "--qk-clip-alpha",
      "--qk-clip-threshold", "--fim-rate", "--fim-spm-rate", "--fim-split-sample",
      "--fim-fragment-rate", "--fim-no-prefix", "--fim-prefix-token", "--fim-middle-token",
      "--fim-suffix-token", "--fim-pad-token", "--fim-eod-token", "--kitchen-attention-backend",
      "--min-offloaded-tensor-size", "--dsa-indexer-n-heads",
      "--dsa-indexer-head-dim", "--dsa-indexer-topk", "--dsa-indexer-loss-coeff",
      "--mtp-loss-scaling-factor", "--moe-deepep-num-sms", "--moe-hybridep-num-sms"),
     "a setting of a model, dataset, tokenizer or feature this run does not use (BERT / vision / "
     "retrieval / Mamba models, FIM data, Muon, CPU offload, the flex MoE "
     "dispatcher); " + _NO_PRETRAIN + " without that feature"),
    (("--moe-use-legacy-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion",
      "--moe-shared-expert-overlap"),
     "a mixture-of-experts kernel / overlap switch (legacy GroupedMLP, transformer-engine fused "
     "permute and router kernels, shared experts on a side stream); the experts compute the same "
     "result without it"),
    (("--moe-per-layer-logging",),
     "a logging switch; megatron_ext logs the load-balancing loss summed over layers"),
    (("--moe-pad-experts-for-cuda-graph-inference",),
     "an inference-with-CUDA-graphs setting; " + _NO_PRETRAIN),
    (("--fp8-interval",), "deprecated: Transformer Engine >= 1.8 ignores the FP8 scaling "
     "interval (Megatron-LM only warns when it is not 1, extensions/transformer_engine.py:"
     "2213-2215)"),
    (("--perform-rl-step",), "reinforcement-learning switch read by Megatron-LM's train_rl.py; "
     + _NO_PRETRAIN),
)
# inference and RL scripts' settings: pretrain_gpt.py never runs them
NO_EFFECT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("--inference-", "an inference-engine setting; " + _NO_PRETRAIN),
    ("--rl-", "a reinforcement-learning setting read by Megatron-LM's train_rl.py; "
     + _NO_PRETRAIN),
    ("--no-rl-", "a reinforcement-learning setting read by Megatron-LM's train_rl.py; "
     + _NO_PRETRAIN),
    ("--grpo-", "a GRPO setting read by Megatron-LM's train_rl.py; " + _NO_PRETRAIN),
    ("--langrl-", "a reinforcement-learning setting read by Megatron-LM's train_rl.py; "
     + _NO_PRETRAIN),
    ("--no-inference-", "an inference-engine setting; " + _NO_PRETRAIN),
    ("--no-langrl-", "a reinforcement-learning setting read by Megatron-LM's train_rl.py; "
     + _NO_PRETRAIN),
    ("--dino-", "a DINO vision-model setting; " + _NO_PRETRAIN),
    # core_v0.19.0's
    ("--mamba-inference-", "an inference-engine setting; " + _NO_PRETRAIN),
    ("--pytorch-profiler-", "a profiler switch; profile with `megatron-ext profile` or "
     "torch.profiler around pretrain_gpt.py"),
    ("--flight-recorder-", "an NCCL flight-recorder (debug dump) setting; it does not change "
     "the model or the maths"),
    ("--no-flight-recorder-", "an NCCL flight-recorder (debug dump) setting; it does not change "
     "the model or the maths"),
    ("--disable-flight-recorder-", "an NCCL flight-recorder (debug dump) setting; it does not "
     "change the model or the maths"),
)
_INFERENCE_ONLY = ("--flash-decode", "--max-tokens-to-oom", "--decode-only-cuda-graphs",
                   "--enable-chunked-prefill", "--disable-chunked-prefill",
                   "--mlp-chunks-for-prefill", "--use-legacy-static-engine",
                   "--nccl-all-reduce-for-prefill", "--refit-method")

# (options, unsupported feature, what to use instead) -- refused unless given Megatron's default.
REFUSED: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--moe-extended-tp",), "the deprecated extended expert tensor parallelism",
     "use --expert-tensor-parallel-size"),
    (("--overlap-moe-expert-parallel-comm", "--ep-overlap-early-attn-memory-release"),
     "overlapping the expert-parallel all-to-all with another micro-batch's compute (it needs "
     "the interleaved pipeline schedule and CUDA streams)", "drop it"),
    (("--moe-enable-deepep", "--moe-flex-dispatcher-backend"),
     "the flex MoE token dispatcher (DeepEP / HybridEP fused all-to-all kernels)",
     "use --moe-token-dispatcher-type alltoall"),
    (("--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8"),
     "padding the routing map for FP8 / FP4 expert GEMMs",
     "drop it: Transformer Engine's grouped expert GEMMs pad each expert's tokens for FP8 "
     "themselves"),
    (("--moe-use-upcycling", "--moe-upcycling-granularity"),
     "upcycling a dense checkpoint into MoE", "train the MoE model from scratch, or convert the "
     "checkpoint offline and --load it"),
    (("--moe-latent-size",), "latent MoE projections (Nemotron-H style)", "drop it"),
    (("--moe-layer-recompute",), "recomputing the MoE layer alone (--recompute-modules moe)",
     "use --recompute-granularity full or selective (core attention)"),
    (("--moe-apply-probs-on-input",), "applying the routing weights to the expert input "
     "(Llama 4)", "drop it (the weights scale the expert output, Megatron-LM's default)"),
    (("--moe-router-force-load-balancing",), "random router logits (a benchmarking mode)",
     "drop it"),
    (("--moe-enable-routing-replay",), "recording and replaying routing decisions (RL)",
     "drop it"),
    (("--cache-mla-latents",), "caching the multi-latent attention latents (an inference "
     "kernel; megatron-core asserts it off in training)", "drop it"),
    (("--mtp-num-layers", "--mtp-standalone"), "multi-token prediction (MTP)", "drop it"),
    (("--fp4-format", "--fp4-recipe", "--fp4-param-gather", "--fp4-quantizer-factory"),
     "FP4 training (NVFP4, Blackwell): the cost model has no FP4 GEMM rates and the runtime no "
     "FP4 path", "use --fp8-format e4m3|hybrid (mxfp8 on Blackwell)"),
    (("--fp8-quantizer-factory",), "a custom FP8 recipe built by a quantizer factory module",
     "use --fp8-recipe delayed, tensorwise, blockwise or mxfp8"),
    (("--reuse-grad-buf-for-mxfp8-param-ag",), "reusing the gradient buffer for the MXFP8 "
     "parameter all-gather (a DDP buffer saving the cost model does not price)", "drop it"),
    (("--te-precision-config-file",), "per-module precision from a Transformer Engine config "
     "file", "use --fp8-format with --first-last-layers-bf16, or a plan's fp8.bf16_layers"),
    (("--use-kitchen-attention",), "NVIDIA Kitchen quantised attention",
     "drop it (core attention stays in bf16 under FP8, as in Megatron-LM's default)"),
    (("--microbatch-group-size-per-virtual-pipeline-stage",),
     "a micro-batch group per virtual stage other than pp",
     "drop it: the interleaved schedule groups pp micro-batches per chunk (Megatron's default)"),
    (("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank"),
     "hybrid (dynamic) context parallelism", "use --context-parallel-size or --flexsp"),
    (("--use-tp-pp-dp-mapping",), "the tp-pp-dp rank order",
     "drop it: megatron_ext orders ranks tp-cp-dp-pp as Megatron-LM's default"),
    (("--overlap-param-gather-with-optimizer-step",), "overlapping the parameter all-gather with "
     "the optimizer step (interleaved pipelines only)", "drop it"),
    (("--torch-fsdp2-no-reshard-after-forward", "--outer-dp-sharding-strategy",
      "--enable-full-sharding-in-hsdp"), "FSDP variants other than full resharding",
     "use --use-torch-fsdp2 or a plan with zero=3"),
    (("--cpu-offloading-num-layers", "--fine-grained-activation-offloading", "--offload-modules",
      "--distribute-saved-activations", "--optimizer-cpu-offload"),
     "activation / optimizer CPU offloading", "use recompute (--recompute-granularity)"),
    (("--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
      "--exp-avg-dtype", "--exp-avg-sq-dtype", "--ddp-reduce-scatter-with-fp32-accumulation",
      "--ddp-average-in-collective"),
     "reduced-precision optimizer states and gradient reductions",
     "drop it: megatron_ext keeps fp32 main parameters, gradients and Adam states"),
    (("--decoupled-lr", "--decoupled-min-lr"), "a separate learning rate for the embedding "
     "(decoupled LR)", "use one --lr"),
    (("--no-weight-decay-cond-type", "--apply-wd-to-qk-layernorm"),
     "custom weight-decay conditions", "drop it: biases and norms get no weight decay, as in "
     "Megatron-LM's default"),
    (("--squared-relu", "--quick-geglu", "--openai-gelu", "--glu-linear-offset",
      "--activation-func-clamp-value"),
     "MLP activations other than gelu and SwiGLU", "use the default gelu or --swiglu"),
    (("--apply-layernorm-1p",), "zero-centred (1 + gamma) layer norms",
     "drop it (megatron_ext's layer specs use plain LayerNorm / RMSNorm)"),
    (("--apply-residual-connection-post-layernorm", "--fp32-residual-connection"),
     "changed residual connections", "drop it: megatron_ext runs Megatron-LM's default pre-norm "
     "residual"),
    (("--qk-l2-norm", "--qk-clip", "--attention-output-gate", "--experimental-attention-variant",
      "--dsa-indexer-use-sparse-loss", "--softmax-type", "--window-size",
      "--window-attn-skip-freq", "--no-rope-freq", "--mrope-section", "--rotary-interleaved",
      "--linear-attention-freq"),
     "attention variants (sliding windows, gated / linear / sparse attention, L2 qk norm, "
     "no-RoPE layers, interleaved or multimodal RoPE)",
     "use standard causal attention with RoPE or learned positions"),
    (("--is-hybrid-model", "--hybrid-attention-ratio", "--hybrid-mlp-ratio",
      "--hybrid-override-pattern"), "hybrid Mamba models", "train a GPT model"),
    (("--spec", "--yaml-cfg", "--heterogeneous-layers-config-path",
      "--heterogeneous-layers-config-encoded-json", "--use-legacy-models", "--encoder-num-layers",
      "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length"),
     "custom layer specs, heterogeneous layers, YAML configs, legacy and encoder-decoder models",
     "describe the GPT model with flags; per-layer parallel layouts go in --strategy-config"),
    (("--embedding-init-method-std", "--init-method-xavier-uniform", "--data-parallel-random-init",
      "--no-initialization"), "other weight initialisations",
     "use --init-method-std (megatron_ext initialises like Megatron-LM's default, the same on "
     "every plan)"),
    (("--fp16-lm-cross-entropy",), "the fp16 cross-entropy", "drop it (the loss is fp32)"),
    (("--non-persistent-save-interval", "--non-persistent-ckpt-type",
      "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
      "--non-persistent-local-ckpt-algo", "--save-retain-interval", "--pretrained-checkpoint",
      "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args",
      "--ckpt-convert-format", "--ckpt-convert-save",
      "--ckpt-convert-update-legacy-dist-opt-format", "--load-main-params-from-ckpt",
      "--save-wgrads-interval", "--save-dgrads-interval"),
     "this checkpoint feature (non-persistent / local checkpoints, retention, conversion, "
     "reading arguments from a checkpoint, gradient dumps)",
     "use --save / --save-interval / --load (resharded across plans)"),
    (("--fim-data", "--sft", "--sft-tokenizer-prompt-format", "--multiple-validation-sets",
      "--full-validation", "--phase-transition-iterations", "--per-dataset-sequences-path",
      "--object-storage-cache-path", "--mid-level-dataset-surplus",
      "--allow-ambiguous-pad-tokens", "--data-args-path", "--per-split-data-args-path",
      "--iterations-to-skip"),
     "this data feature (FIM or SFT data, several validation sets, multi-phase data, object "
     "storage, data-argument files, skipped iterations)",
     "use --data-path / --split or --train/valid/test-data-path"),
    (("--tokenizer-metadata", "--tokenizer-special-tokens",
      "--tokenizer-hf-include-special-tokens", "--vocab-extra-ids"),
     "tokenizer extensions (added special tokens, metadata)",
     "use the tokenizer as its files define it"),
    (("--fake-process-group", "--test-mode", "--lazy-mpu-init"),
     "Megatron-LM's test and lazy-initialisation modes", "drop it"),
    (("--batch-size", "--model-parallel-size", "--warmup", "--checkpoint-activations"),
     "this deprecated flag (Megatron-LM rejects it too)",
     "use --micro-batch-size, --tensor-model-parallel-size, --lr-warmup-fraction or "
     "--recompute-activations"),
    (("--decrease-batch-size-if-needed",), "changing the batch size during training",
     "drop it"),
    # Not implemented on megatron_ext's training path yet; honoured once it is.
    (("--skip-train",), "evaluation-only runs", "drop it"),
    (("--num-distributed-optimizer-instances",), "several distributed-optimizer instances",
     "use 1"),
    (("--use-megatron-fsdp",), "Megatron FSDP", "use --use-torch-fsdp2 or a plan with zero=3"),
    (("--no-save-optim", "--no-save-rng"), "checkpoints without optimizer or RNG state",
     "drop it: checkpoints hold both, so a resume continues exactly"),
    (("--dataloader-type",), "data loaders other than Megatron-LM's single (cyclic, external)",
     "drop it"),
    (("--ckpt-format",), "checkpoint formats other than torch_dist",
     "use torch_dist (the format that reshards across plans)"),
)
REFUSED_PREFIXES: tuple[tuple[str, str, str], ...] = (
    ("--tp-comm-", "transformer-engine tensor-parallel communication overlap", "drop it"),
    ("--no-tp-comm-", "transformer-engine tensor-parallel communication overlap", "drop it"),
    ("--disable-tp-comm-", "transformer-engine tensor-parallel communication overlap",
     "drop it"),
)

PLANNER_ONLY = ("--tp-comm-overlap",)
"""Flags the parser honours for the planner (plan-from-args, evaluate, args, validate price
them) and the training runtime refuses with the line of runtime_refusal: Transformer Engine's
userbuffers need CUDA and are never run by megatron_ext's runtime."""


def runtime_refusal(option: str) -> str:
    """The training runtime's one-line refusal of a PLANNER_ONLY flag: the refused-prefix line
    the flag had before the planner took it up."""
    assert option in PLANNER_ONLY, option
    rule = next(r for r in REFUSED_PREFIXES if option.startswith(r[0]))
    return Entry(megatron_flags()[option], "refused", rule[1], rule[2]).refusal()


def _explicit_rules() -> dict[str, tuple[Kind, str, str]]:
    rules: dict[str, tuple[Kind, str, str]] = {}
    for options, reason in NO_EFFECT:
        for option in options:
            rules[option] = ("no_effect", reason, "")
    for option in _INFERENCE_ONLY:
        rules[option] = ("no_effect", "an inference-engine setting; " + _NO_PRETRAIN, "")
    for options, feature, instead in REFUSED:
        for option in options:
            if option in rules:
                raise AssertionError(f"{option} is classified twice")
            rules[option] = ("refused", feature, instead)
    return rules


@cache
def option_sets() -> dict[str, frozenset[str]]:
    """catalog version -> its option strings."""
    return {c.version: frozenset(megatron_flags(c)) for c in CATALOGS}


@cache
def catalog(honoured: frozenset[str], version: FlagCatalogVersion = BASE) -> dict[str, Entry]:
    """Every Megatron-LM option of `version` -> its Entry; `honoured` are the options parser.py
    defines."""
    rules = _explicit_rules()
    table: dict[str, Entry] = {}
    base = megatron_flags(BASE)
    for option, flag in megatron_flags(version).items():
        if option in rules:
            kind, reason, instead = rules[option]
            table[option] = Entry(flag, kind, reason, instead)
            continue
        prefix_refused = next((r for r in REFUSED_PREFIXES if option.startswith(r[0])), None)
        prefix_no_effect = next((r for r in NO_EFFECT_PREFIXES if option.startswith(r[0])), None)
        if option in honoured:
            table[option] = Entry(flag, "honoured")
        elif prefix_refused is not None:
            table[option] = Entry(flag, "refused", prefix_refused[1], prefix_refused[2])
        elif prefix_no_effect is not None:
            table[option] = Entry(flag, "no_effect", prefix_no_effect[1])
        elif option not in base:
            table[option] = Entry(flag, "refused", f"this {version.tag} feature",
                                  "drop it (megatron_ext has not taken it up yet)")
        else:
            raise AssertionError(f"Megatron-LM flag {option} has no class in catalog.py")
    return table


def class_sizes(table: dict[str, Entry]) -> dict[str, int]:
    sizes = {"honoured": 0, "no_effect": 0, "refused": 0}
    for entry in table.values():
        sizes[entry.kind] += 1
    return sizes


def given_options(argv: Iterable[str], options: Iterable[str]) -> list[str]:
    """The options of `options` that appear in argv (`--flag value` or `--flag=value`)."""
    known = set(options)
    seen: list[str] = []
    for token in argv:
        option = token.split("=", 1)[0]
        if option in known and option not in seen:
            seen.append(option)
    return seen


def is_default(entry: Entry, value: Any) -> bool:
    """Whether `value` (parsed as parser.py adds unhonoured flags) is Megatron-LM's default."""
    default = entry.flag.default_value()
    if entry.flag.nargs == 0:
        return value == default
    if isinstance(value, list) and not isinstance(default, list) and len(value) == 1:
        value = value[0]
    try:
        if entry.flag.type == "int":
            return int(value) == default
        if entry.flag.type == "float":
            return float(value) == float(default)
    except (TypeError, ValueError):
        return False
    return value == default or str(value) == str(default)


ALSO_ACCEPTED = {"--dataloader-type": ("single",)}
"""Non-default values a refused flag accepts because they mean what megatron_ext does
(Megatron-LM's default None for --dataloader-type means single)."""


def check_unhonoured(ns: Any, argv: Iterable[str], table: dict[str, Entry]) -> list[Entry]:
    """Raise the one-line refusal of the first refused flag given with a non-default value;
    return the no-effect flags given (for the start-up log)."""
    argv = list(argv)
    notes: list[Entry] = []
    for option in given_options(argv, (o for o, e in table.items() if e.kind != "honoured")):
        entry = table[option]
        value = getattr(ns, entry.flag.dest, None)
        if (entry.kind == "refused" and not is_default(entry, value)
                and value not in ALSO_ACCEPTED.get(option, ())):
            raise PlanError(entry.refusal(None if entry.flag.nargs == 0 else value))
        if entry.kind == "no_effect":
            notes.append(entry)
    return notes


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
