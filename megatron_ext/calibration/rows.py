"""A published run (one row of the published-runs schema) as what the cost model scores: its
Megatron-LM flags and plan, the cluster it ran on, how it executed, and its measured time.

What the rows do not state is filled in by fixed rules (no per-row choice):
  - micro-batch size not stated -> 1 (what SC'21 Table 2 and Korthikanti et al. use at scale);
  - interleaving "degree not stated" -> the largest divisor of layers-per-stage <= 3
    (Korthikanti et al. state 3 for the same authors' 175B/530B runs);
  - recompute not stated (NeMo 5B) -> none (NeMo's default when the recipe omits it);
  - flash attention only where the source says so (MosaicML, or a row's `flash_attention`);
    sources from 2020-2022 without it keep the attention scores unless recomputed;
  - dropout on (Megatron's 0.1) except MosaicML MPT (dropout 0) or a row's `dropout: false`;
  - every DeepSpeed row runs on DeepSpeed's engine (TrainingSpec.engine "deepspeed", evaluate
    --engine deepspeed): ZeRO-3 rows hold at most its default 1e9 gathered parameters
    (stage3_max_live_parameters), FSDP rows two whole layers;
  - Megatron rows keep plain DDP (zero=0, the 2020-2022 code had no distributed optimizer in
    these runs) and reduce the gradients after the last backward (that code had no
    --overlap-grad-reduce; Korthikanti et al. say so of their 530B DP-8 run); a row's
    `overlap_grad_reduce` / `overlap_param_gather` / `tp_comm_overlap` turn Megatron-LM's
    flags on (the last where the source states it: MLPerf's TP_COMM_OVERLAP=True), and
    `overlap_p2p_comm` prices the interleaved schedule's overlapped pipeline messages
    (Megatron-Core's default with virtual stages, which the 2025 NeMo rows ran); DeepSpeed
    ZeRO-3 and PyTorch FSDP FULL_SHARD rows are zero=3; DeepSpeed ZeRO-1
    rows (Megatron-DeepSpeed, BLOOM) are zero=1 with DeepSpeed's pipeline engine: gradient
    reduction and weight gather after the last backward, not overlapped; rows on DeepSpeed's
    BF16_Optimizer (Lucie-7B) run "deepspeed-bf16" (`engine_of`);
  - a row that states its network (`inter_node_bytes_per_s_per_gpu`, derived in cluster_notes
    from the cluster's published spec) is priced on the GPU preset with that inter-node
    bandwidth, and forms its own cluster (`cluster_label`) in sweeps and intervals; a row's
    `run_date` splits a sweep where the source says the cluster changed between days;
  - a row whose GPU or kernels are not the preset's states them (`hardware_notes` says where
    each figure comes from): `peak_flops` / `peak_fp8_flops` replace the preset's peaks and
    `kernel_profile` (ComputeProfile fields: the memory bandwidth, the attention kernel's
    share of peak) is laid over the cost model's constants, as a user's measured model
    profile would be (`compute_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_ext.flags.parser import parse_megatron_args
from megatron_ext.flags.to_plan import plan_from_megatron_args
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost.compute import ComputeProfile
from megatron_ext.presets import cluster_preset
from megatron_ext.specs import ClusterSpec


def is_zero3(row: dict[str, Any]) -> bool:
    return "ZeRO-3" in str(row.get("dp_sharding"))


def is_zero1(row: dict[str, Any]) -> bool:
    return "ZeRO-1" in str(row.get("dp_sharding"))


def is_deepspeed_pipeline(row: dict[str, Any]) -> bool:
    """Megatron-DeepSpeed with DeepSpeed's engine and ZeRO stage 0 or 1 (BLOOM's ZeRO-1 rows,
    vTrain's rows): its pipeline schedule reduces the gradients (ReduceGrads, ReduceTiedGrads)
    after the last micro-batch's backward and ZeRO-1 gathers the updated weights after the step,
    neither overlapped with compute, where Megatron-LM overlaps both (--overlap-grad-reduce,
    --overlap-param-gather). Its pipeline messages are split over the tensor-parallel ranks
    (is_pipe_partitioned) as Megatron's scatter-gather splits them, so they are priced the
    same. Lucie's --no-pipeline-parallel rows run DeepSpeed's engine without the pipeline
    module: with ZeRO stage 0 and overlap_comm off it all-reduces the gradients in buckets after
    the last micro-batch's backward (allreduce_gradients at the accumulation boundary), the
    same unhidden reduction."""
    return "DeepSpeed" in str(row.get("dp_sharding")) and not is_zero3(row)


def is_mosaic(row: dict[str, Any]) -> bool:
    return str(row["source"]).startswith("MosaicML")


def flash_attention_of(row: dict[str, Any]) -> bool:
    """The row's `flash_attention` where it states one, else on only for MosaicML (the only
    JSON source that says so; the 2020-2022 Megatron runs kept the attention scores)."""
    value = row.get("flash_attention")
    return is_mosaic(row) if value is None else bool(value)


def dropout_of(row: dict[str, Any]) -> bool:
    """The row's `dropout` where it states one, else Megatron's 0.1 except for MosaicML (0)."""
    value = row.get("dropout")
    return (not is_mosaic(row)) if value is None else bool(value)


def is_swiglu(row: dict[str, Any]) -> bool:
    return str(row.get("ffn_type") or "").lower().startswith("swiglu")


def recompute_of(row: dict[str, Any]) -> str:
    text = str(row.get("recompute") or "none").lower()
    if text.startswith("selective"):
        return "selective"
    if text.startswith("full"):
        return "full"
    return "none"


def micro_batch_of(row: dict[str, Any]) -> int:
    return int(row["micro_batch_size"] or 1)


def virtual_stages_of(row: dict[str, Any]) -> int:
    """Interleaving degree: stated, or by the documented rule when only 'interleaved' is said."""
    vp, pp = row.get("vp"), int(row["pp"])
    if pp == 1 or vp is None:
        return 1
    if isinstance(vp, int):
        return vp
    per_stage = int(row["num_layers"]) // pp
    return max(d for d in (1, 2, 3) if per_stage % d == 0)


def cluster_name(row: dict[str, Any]) -> str:
    """The GPU preset the row is priced on (its kernel constants): the row's `cluster_preset`
    where it names one (the H100 / GB200 / GB300 rows of published_runs_fp8.json), else the A100
    preset of its memory size."""
    if row.get("cluster_preset"):
        return str(row["cluster_preset"])
    gpu = str(row["gpu_type"])
    return "dgx-a100-80g" if "80GB" in gpu else "dgx-a100-40g"


def cluster_label(row: dict[str, Any]) -> str:
    """The cluster a sweep ran on: the preset, or the row's own cluster where its network differs
    from the preset's (`cluster_label`, with `inter_node_bytes_per_s_per_gpu` from its spec)."""
    return str(row.get("cluster_label") or cluster_name(row))


def cluster_of(row: dict[str, Any]) -> ClusterSpec:
    """The preset with the row's node count; a row that states its network
    (inter_node_bytes_per_s_per_gpu, derived in cluster_notes from the cluster's published
    spec) gets that inter-node bandwidth instead of the DGX's 8 HDR NICs."""
    gpus, per_node = int(row["num_gpus"]), int(row["gpus_per_node"])
    if row.get("nvlink_domain_gpus"):  # an NVL72 job using part of each rack (its SEGMENT)
        cluster = dataclasses.replace(cluster_preset(cluster_name(row)), num_nodes=gpus // per_node,
                                      nvlink_domain_size=int(row["nvlink_domain_gpus"]))
    else:
        cluster = cluster_preset(cluster_name(row), num_nodes=max(1, gpus // per_node))
    if gpus < per_node:  # a partial node (the 2020 single-node weak-scaling rows)
        cluster = dataclasses.replace(cluster, gpus_per_node=gpus)
    if row.get("inter_node_bytes_per_s_per_gpu"):
        link = dataclasses.replace(cluster.inter_node, bandwidth_bytes_per_s=float(
            row["inter_node_bytes_per_s_per_gpu"]))
        cluster = dataclasses.replace(cluster, inter_node=link)
    if row.get("peak_flops"):
        cluster = dataclasses.replace(cluster, peak_flops=float(row["peak_flops"]))
    if row.get("peak_fp8_flops"):
        cluster = dataclasses.replace(cluster, peak_fp8_flops=float(row["peak_fp8_flops"]))
    return cluster


def compute_of(row: dict[str, Any], compute: ComputeProfile) -> ComputeProfile:
    """`compute` with the row's `kernel_profile` laid over it: what the run's GPU and kernels
    are known to reach where they are not what the constants assume (torchtitan's H100 rows:
    HBM2e at 2.4 TB/s, PyTorch SDPA's FlashAttention-2 kernels)."""
    stated = row.get("kernel_profile")
    if not stated:
        return compute
    checked = ComputeProfile.from_dict(stated, f"row {row['id']}: kernel_profile")
    return dataclasses.replace(compute, **{k: getattr(checked, k) for k in stated})


def megatron_flags(row: dict[str, Any]) -> list[str]:
    """The run as Megatron-LM flags (what a user would pass to plan-from-args). A row of a
    Llama-style model states `ffn_type` "swiglu", `normalization`, `position_embedding`,
    `tied_embeddings: false` and `bias_linear: false`; rows without them are GPT (GeLU 4h,
    LayerNorm, learned positions, tied embeddings, biases except MosaicML's)."""
    flags = [
        "--num-layers", row["num_layers"], "--hidden-size", row["hidden_size"],
        "--num-attention-heads", row["num_heads"], "--ffn-hidden-size", row["ffn_hidden_size"],
        "--vocab-size", row["vocab_size"], "--seq-length", row["seq_len"],
        "--max-position-embeddings", row["seq_len"],
        "--tensor-model-parallel-size", row["tp"], "--pipeline-model-parallel-size", row["pp"],
        "--micro-batch-size", micro_batch_of(row), "--global-batch-size", row["global_batch_size"],
        "--bf16" if "bf16" in str(row["precision"]) else "--fp16",
    ]
    if row.get("sequence_parallel") and int(row["tp"]) > 1:
        flags.append("--sequence-parallel")
    kv = int(row.get("num_kv_heads") or row["num_heads"])
    if kv < int(row["num_heads"]):
        flags += ["--group-query-attention", "--num-query-groups", str(kv)]
    if row.get("tp_comm_overlap"):  # the config's TP_COMM_OVERLAP (needs SP, tp > 1)
        flags.append("--tp-comm-overlap")
    if int(row.get("cp") or 1) > 1:
        flags += ["--context-parallel-size", str(row["cp"])]
    flags += fp8_flags(row)
    if row.get("uneven_embedding_loss_stages"):
        flags += ["--account-for-embedding-in-pipeline-split",
                  "--account-for-loss-in-pipeline-split"]
    if is_mosaic(row) or row.get("bias_linear") is False:
        flags.append("--disable-bias-linear")
    if not dropout_of(row):
        flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if is_swiglu(row):
        flags.append("--swiglu")
    if row.get("normalization"):
        flags += ["--normalization", row["normalization"]]
    if row.get("position_embedding"):
        flags += ["--position-embedding-type", row["position_embedding"]]
    if row.get("tied_embeddings") is False:
        flags.append("--untie-embeddings-and-output-weights")
    rc = recompute_of(row)
    if rc == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif rc == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    v = virtual_stages_of(row)
    if v > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", v]
    if is_zero3(row) or is_zero1(row) or row.get("distributed_optimizer"):
        flags.append("--use-distributed-optimizer")  # ZeRO-3: raised to zero=3 by build_plan
    return [str(f) for f in flags]


def fp8_flags(row: dict[str, Any]) -> list[str]:
    """An FP8 row's Megatron-LM FP8 flags: --fp8-format, --fp8-recipe, --fp8-param-gather as
    its configuration sets them (`fp8_format`, `fp8_recipe`, `fp8_param_gather`)."""
    if not row.get("fp8_format"):
        return []
    flags = ["--fp8-format", str(row["fp8_format"]), "--fp8-recipe", str(row["fp8_recipe"])]
    return flags + (["--fp8-param-gather"] if row.get("fp8_param_gather") else [])


def build_plan(row: dict[str, Any]) -> ParallelPlan:
    """plan-from-args on the row's flags. ZeRO-3 rows: Megatron-LM's --use-torch-fsdp2 requires
    untied embeddings, which these GPT runs did not have, so their flags say
    --use-distributed-optimizer and every layer's zero is raised to 3 here."""
    world = int(row["num_gpus"])
    ns = parse_megatron_args(megatron_flags(row), world_size=world)
    plan = plan_from_megatron_args(ns, world)
    if is_zero3(row):
        plan = dataclasses.replace(
            plan, layers=tuple(dataclasses.replace(s, zero=3) for s in plan.layers)
        )
    return plan

def engine_of(row: dict[str, Any]) -> str:
    """DeepSpeed rows run on DeepSpeed's engine, those whose `dp_sharding` names its
    BF16_Optimizer (Lucie-7B, with or without the pipeline module) on "deepspeed-bf16"."""
    sharding = str(row.get("dp_sharding"))
    if "DeepSpeed" not in sharding:
        return "megatron"
    return "deepspeed-bf16" if "BF16_Optimizer" in sharding else "deepspeed"


def run_settings(row: dict[str, Any]) -> dict[str, Any]:
    """How the row's run executes beyond its plan: planner.cost.evaluate.plan_training's
    keywords, which `megatron-ext evaluate` takes as evaluate_flags(row)."""
    return {"flash_attention": flash_attention_of(row), "dropout": dropout_of(row),
            "engine": engine_of(row),
            "overlap_grad_reduce": bool(row.get("overlap_grad_reduce", False)),
            "overlap_param_gather": bool(row.get("overlap_param_gather", False)),
            "overlap_p2p_comm": bool(row.get("overlap_p2p_comm", False))}


def evaluate_flags(row: dict[str, Any]) -> list[str]:
    """run_settings(row) and the row's kernel_profile (compute_of) as `megatron-ext evaluate`
    flags."""
    s = run_settings(row)
    return ((["--no-flash-attention"] if not s["flash_attention"] else [])
            + (["--no-dropout"] if not s["dropout"] else []) + ["--engine", s["engine"]]
            + (["--overlap-grad-reduce"] if s["overlap_grad_reduce"] else [])
            + (["--overlap-param-gather"] if s["overlap_param_gather"] else [])
            + (["--megatron-p2p-overlap"] if s["overlap_p2p_comm"] else [])
            + [f"--compute-constant={k}={v!r}"
               for k, v in (row.get("kernel_profile") or {}).items()])


def eq3_flops(row: dict[str, Any]) -> float:
    """Narayanan et al. SC'21 eq. (3): F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration
    (counts the recomputed forward)."""
    b, s, n_layers, h, v = (row["global_batch_size"], row["seq_len"], row["num_layers"],
                            row["hidden_size"], row["vocab_size"])
    return 96.0 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))


def measured_iteration_s(row: dict[str, Any]) -> tuple[float, str]:
    """Seconds per iteration from the source's own figure and convention."""
    unit = str(row["measured_unit"])
    tokens = row["global_batch_size"] * row["seq_len"]
    if row.get("iter_time_s") is not None:
        return float(row["iter_time_s"]), "iteration time"
    if "TFLOP/s" in unit and "eq.(3)" in str(row["flops_convention"]):
        seconds = eq3_flops(row) / (row["tflops_per_gpu"] * 1e12 * row["num_gpus"])
        return seconds, "eq.(3) FLOPs / (TFLOP/s x GPUs)"
    if row.get("tokens_per_s_total"):
        return tokens / float(row["tokens_per_s_total"]), "batch tokens / tokens/s"
    if row.get("tokens_per_s_per_gpu"):
        return tokens / (float(row["tokens_per_s_per_gpu"]) * row["num_gpus"]), (
            "batch tokens / (tokens/s/GPU x GPUs)")
    raise ValueError(f"row {row['id']}: no measured figure this tool can convert")


def layout_label(row: dict[str, Any]) -> str:
    parts = [f"tp{row['tp']}", f"pp{row['pp']}", f"dp{row['dp']}"]
    if is_zero3(row):
        parts.append("z3")
    if row.get("deepspeed_pipeline_engine") is False:
        parts.append("nopipe")
    if row.get("sequence_parallel"):
        parts.append("sp")
    v = virtual_stages_of(row)
    if v > 1:
        parts.append(f"v{v}")
    if int(row.get("cp") or 1) > 1:
        parts.append(f"cp{row['cp']}")
    if row.get("fp8_recipe"):
        parts.append(f"fp8:{str(row['fp8_recipe'])[:5]}")
    parts.append(f"mb{micro_batch_of(row)}")
    rc = recompute_of(row)
    if rc != "none":
        parts.append(f"rc:{rc[:3]}")
    return " ".join(parts)
