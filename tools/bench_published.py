"""The GPU cost model against published A100 training runs: predicted vs measured iteration time.

    python tools/bench_published.py [--data PATH] [--json OUT.json] [--rows ID ...]

Each row of the data file (default tools/data/published_runs_a100.json, `about` says what it
holds; every row cites its source and quotes it) is one measured run of a dense GPT model with
its layout. For every row this
  1. writes the run as Megatron-LM flags and builds its plan with plan-from-args (ZeRO-3 rows:
     --use-distributed-optimizer, then zero=3 on every layer, see build_plan);
  2. predicts the iteration time with the cost model on the cluster preset the run used
     (dgx-a100-80g, or dgx-a100-40g for 40 GB GPUs and the 2020 DGX A100), with Megatron's
     interleaved schedule priced approximately where the run used it (`virtual_stages`);
  3. converts the measured figure to seconds per iteration with the source's own convention
     (`measured_unit`, `flops_convention`): TFLOP/s per GPU under Narayanan et al. eq. (3)
     -> F / (TFLOP/s x GPUs); tokens/s -> global batch x seq / tokens/s; or the iteration time.
It prints per row predicted/measured, then the median |error|, how many rows are optimistic
(predicted faster) or pessimistic, memory false negatives (runs that ran but are predicted not
to fit), and Spearman's rank correlation of predicted vs measured GPU-seconds per token among
the layouts of one model within one source (per-token GPU time, not iteration time, so runs on
different GPU counts compare on efficiency, not on size).

What the rows do not state is filled in by fixed rules (no per-row choice):
  - micro-batch size not stated -> 1 (what SC'21 Table 2 and Korthikanti et al. use at scale);
  - interleaving "degree not stated" -> the largest divisor of layers-per-stage <= 3
    (Korthikanti et al. state 3 for the same authors' 175B/530B runs);
  - recompute not stated (NeMo 5B) -> none (NeMo's default when the recipe omits it);
  - flash attention only where the source says so (MosaicML, or a row's `flash_attention`);
    sources from 2020-2022 without it keep the attention scores unless recomputed;
  - dropout on (Megatron's 0.1) except MosaicML MPT (dropout 0) or a row's `dropout: false`;
  - DeepSpeed ZeRO-3 rows hold at most DeepSpeed's default 1e9 gathered parameters
    (stage3_max_live_parameters), FSDP rows two whole layers;
  - Megatron rows keep plain DDP (zero=0, the 2020-2022 code had no distributed optimizer in
    these runs); DeepSpeed ZeRO-3 and PyTorch FSDP FULL_SHARD rows are zero=3; DeepSpeed ZeRO-1
    rows (Megatron-DeepSpeed, BLOOM) are zero=1 with DeepSpeed's pipeline engine: gradient
    reduction and weight gather after the last backward, not overlapped;
  - a row that states its network (`inter_node_bytes_per_s_per_gpu`, derived in cluster_notes
    from the cluster's published spec) is priced on the GPU preset with that inter-node
    bandwidth, and forms its own cluster (`cluster_label`) in sweeps and intervals; a row's
    `run_date` splits a sweep where the source says the cluster changed between days.

The vTrain validation measurements (tools/data/vtrain/, README.md there: 1,440 single-node and
109 multi-node Megatron-DeepSpeed runs, the upstream CSVs byte for byte) are read by
vtrain_rows() into rows of the same schema, one rule for every row: vocabulary 50257, ffn 4h,
fp16, no flash attention, no sequence parallelism, 1F1B, full recompute (the configs'
use_checkpoint), DeepSpeed engine without ZeRO (gradients reduced after the last backward, as
vTrain's own simulator schedules them), A100 80GB with the dgx-a100 network, cluster
`vtrain-a100`; a layout the CSV measured twice is one run at the mean. Their sources are
"vTrain single node" and "vTrain multi node" (two held-out sources). They are summarised per
model on stdout (every sweep in --json); --no-vtrain leaves them out.

OpenLLM-France's Lucie-7B parallelism experiments (tools/data/lucie/, README.md there: the
upstream expe_summary.csv byte for byte, 44 lines of Megatron-DeepSpeed runs on Jean Zay's
A100 80GB nodes) are read by lucie_rows() into rows of the same schema, one rule for every row
from the run scripts: Llama-style 32 x 4096, FFN 11008 SwiGLU, 32 heads, RoPE, RMSNorm, untied
embeddings, no biases, seq 4096, bf16, flash attention v2, no dropout, no recompute, no
sequence parallelism, DeepSpeed ZeRO stage 0 (gradients reduced after the last backward, with
or without the pipeline engine), the BLOOM rows' Jean Zay network as cluster
`jean-zay-a100-80g-2024`; vocabulary 32000 (1_seq4k) or 65024 (2_vocab_65k), one model each.
The line of 3_recompute_activation (no script) is left out; a layout measured three times is
one run at the mean. Source "Lucie-7B parallelism (OpenLLM-France)"; --no-lucie leaves them
out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.flags.parser import parse_megatron_args
from megatron_ext.flags.to_plan import plan_from_megatron_args
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost import interval as iv
from megatron_ext.planner.cost.compute import ComputeProfile
from megatron_ext.planner.cost.evaluate import stage_sums
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.cost.pipeline import one_f_one_b
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset
from megatron_ext.specs import ClusterSpec

DEFAULT_DATA = str(Path(__file__).resolve().parent / "data" / "published_runs_a100.json")
GIB = 2**30
DEEPSPEED_MAX_LIVE_PARAMS = 1e9
"""DeepSpeed ZeRO-3's default stage3_max_live_parameters: it gathers module by module and holds
at most this many parameters gathered, where FSDP2 holds two whole layers."""


# ---- row -> run description -------------------------------------------------------------


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
    """The GPU preset the row is priced on (its kernel constants)."""
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
    cluster = cluster_preset(cluster_name(row), num_nodes=max(1, gpus // per_node))
    if gpus < per_node:  # a partial node (the 2020 single-node weak-scaling rows)
        cluster = dataclasses.replace(cluster, gpus_per_node=gpus)
    if row.get("inter_node_bytes_per_s_per_gpu"):
        link = dataclasses.replace(cluster.inter_node, bandwidth_bytes_per_s=float(
            row["inter_node_bytes_per_s_per_gpu"]))
        cluster = dataclasses.replace(cluster, inter_node=link)
    return cluster


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
    if is_zero3(row) or is_zero1(row):
        flags.append("--use-distributed-optimizer")  # ZeRO-3: raised to zero=3 by build_plan
    return [str(f) for f in flags]


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


# ---- vTrain's measured layout sweeps (CSV) -> rows ------------------------------------------

VTRAIN_DIR = Path(__file__).resolve().parent / "data" / "vtrain"
VTRAIN_REPO = "github:VIA-Research/vTrain"
VTRAIN_COMMIT = "f8dda8473a48b373b1d25f51f52d685bff5150c5"
VTRAIN_FILES = {  # file -> (source name, git blob id upstream: the copy is the same bytes)
    "ground_truth_single.csv": ("vTrain single node", "44880f27d5e7801b0b9db896283919fd057162ad"),
    "ground_truth_multi.csv": ("vTrain multi node", "978b10fbfb72dda67a6b7f261402a3d80dfed79b"),
}
VTRAIN_SOURCES = frozenset(source for source, _ in VTRAIN_FILES.values())
VTRAIN_COLUMNS = (  # the CSV header (ground_truth_multi.csv starts with "Parameters (billion)")
    "# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers",
    "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism",
    "iteration time (ms)",
)
VTRAIN_VOCAB = 50257
"""Not in the CSVs: vTrain's model default (GPT-2's BPE vocabulary, which Megatron-DeepSpeed's
GPT examples use); plan-from-args pads it to a multiple of 128 x tp as Megatron does."""
VTRAIN_RULES = {
    "gpu_type": "A100 80GB (size not stated: 80 GB by the rule in tools/data/vtrain/README.md)",
    "gpus_per_node": 8,
    "cluster_label": "vtrain-a100",
    "vocab_size": VTRAIN_VOCAB,
    "vp": None,
    "sequence_parallel": False,
    "dp_sharding": "none (DeepSpeed engine, ZeRO stage 0: not stated, see README.md)",
    "recompute": "full (configs: use_checkpoint=true)",
    "precision": "mixed fp16 (not stated)",
    "measured_unit": "iteration time (ms), CSV column 'iteration time (ms)'",
    "flops_convention": "none (time only)",
}
"""What every vTrain row gets that its CSV line does not say (tools/data/vtrain/README.md)."""


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's bytes (`git hash-object`): equal ids, equal files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _vtrain_fields(path: Path, lineno: int, header: list[str], line: list[str]
                   ) -> dict[str, float]:
    """One CSV line as numbers; a one-line PlanError naming the file, line and field."""
    if len(line) != len(header):
        raise PlanError(f"{path.name} line {lineno}: {len(line)} fields, the header has "
                        f"{len(header)}; fix: one value per column {header}")
    fix = (f"fix: restore the upstream file ({VTRAIN_REPO} data/{path.name} @ "
           f"{VTRAIN_COMMIT[:12]})")
    return {name: csv_number(path, lineno, name, text, fix=fix,
                             integral=name not in ("iteration time (ms)", "Parameters (billion)"))
            for name, text in zip(header, line)}


def csv_number(path: Path, lineno: int, name: str, text: str, *, fix: str, integral: bool,
               minimum: int = 1) -> float | int:
    """One numeric CSV field: a positive number, or an integer >= `minimum`; otherwise a
    one-line PlanError naming the file, line, field and value, ending in `fix`."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if integral:
        ok = math.isfinite(value) and value >= minimum and value == int(value)
        kind = "a positive integer" if minimum >= 1 else f"an integer >= {minimum}"
    else:
        ok = value > 0 and math.isfinite(value)
        kind = "a positive number"
    if not ok:
        raise PlanError(f"{path.name} line {lineno}: field {name!r} = {text!r} is not {kind}; "
                        f"{fix}")
    return int(value) if integral else value


def read_vtrain_csv(path: Path) -> list[dict[str, Any]]:
    """The measured runs of one vTrain CSV, validated, with their line numbers."""
    text = Path(path).read_text(encoding="utf-8-sig")
    lines = list(csv.reader(text.splitlines()))
    if not lines:
        raise PlanError(f"{path.name}: empty; fix: restore the upstream file")
    header = [h.strip() for h in lines[0]]
    expected = list(VTRAIN_COLUMNS)
    if header[:1] == ["Parameters (billion)"]:
        expected = ["Parameters (billion)", *expected]
    if header != expected:
        raise PlanError(f"{path.name} line 1: header {header} is not vTrain's {expected}; fix: "
                        "restore the upstream file")
    runs = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        f = _vtrain_fields(path, lineno, header, line)
        if f["tensor parallelism"] * f["data parallelism"] * f["pipeline parallelism"] != f[
                "# GPUs"]:
            raise PlanError(f"{path.name} line {lineno}: field '# GPUs' = {f['# GPUs']} is not "
                            "tensor x data x pipeline parallelism "
                            f"({f['tensor parallelism']} x {f['data parallelism']} x "
                            f"{f['pipeline parallelism']}); fix: restore the upstream file")
        if f["global batch"] % (f["micro batch"] * f["data parallelism"]):
            raise PlanError(f"{path.name} line {lineno}: field 'global batch' = "
                            f"{f['global batch']} is not a multiple of micro batch x data "
                            "parallelism; fix: restore the upstream file")
        runs.append({"line": lineno, **f})
    return runs


def vtrain_rows(directory: Path | None = None) -> list[dict[str, Any]]:
    """vTrain's measured runs as rows of the published-runs schema: the CSV's own values plus
    VTRAIN_RULES, the same for every row. A layout measured twice in one file (the multi-node
    CSV has one) is one run at the mean of its measurements."""
    rows: list[dict[str, Any]] = []
    for name, (source, _) in VTRAIN_FILES.items():
        path = Path(directory or VTRAIN_DIR) / name
        by_layout: dict[tuple, list[dict[str, Any]]] = {}
        for run in read_vtrain_csv(path):
            key = tuple(v for k, v in run.items() if k not in ("line", "iteration time (ms)"))
            by_layout.setdefault(key, []).append(run)
        for runs in by_layout.values():
            r = runs[0]
            layers, hidden, seq = r["# layers"], r["hidden size"], r["sequence length"]
            tp, pp, dp = (r["tensor parallelism"], r["pipeline parallelism"],
                          r["data parallelism"])
            params = r.get("Parameters (billion)")
            if params is None:  # GPT weights with tied embeddings and learned positions
                params = (layers * (12 * hidden * hidden + 13 * hidden)
                          + (VTRAIN_VOCAB + seq + 2) * hidden) / 1e9
            size = f"{params:.2f}".rstrip("0").rstrip(".")
            lines = ", ".join(str(x["line"]) for x in runs)
            rows.append({
                **VTRAIN_RULES,
                "id": (f"vtrain-{name.split('_')[-1][:-4]}-{r['line']}-{layers}x{hidden}-"
                       f"g{r['# GPUs']}-gbs{r['global batch']}-tp{tp}pp{pp}dp{dp}-"
                       f"mb{r['micro batch']}"),
                "source": source,
                "source_ref": f"{VTRAIN_REPO} data/{name} @ {VTRAIN_COMMIT[:12]}, line {lines}",
                "num_gpus": r["# GPUs"],
                "model_name": f"GPT {size}B ({layers} x {hidden})",
                "num_layers": layers, "hidden_size": hidden, "num_heads": r["attention heads"],
                "ffn_hidden_size": 4 * hidden, "seq_len": seq,
                "tp": tp, "pp": pp, "dp": dp,
                "global_batch_size": r["global batch"], "micro_batch_size": r["micro batch"],
                "iter_time_s": statistics.fmean(x["iteration time (ms)"] for x in runs) / 1e3,
                "repeats": len(runs),
            })
    return rows


def changed_copies(directory: Path, blobs: dict[str, str]) -> list[str]:
    """The files of `blobs` (name -> upstream git blob id) whose bytes in `directory` differ."""
    return [name for name, blob in blobs.items()
            if git_blob_id((Path(directory) / name).read_bytes()) != blob]


def check_vtrain_files(directory: Path | None = None) -> list[str]:
    """Files whose bytes differ from the upstream blobs recorded in VTRAIN_FILES."""
    return changed_copies(directory or VTRAIN_DIR,
                          {name: blob for name, (_, blob) in VTRAIN_FILES.items()})


# ---- OpenLLM-France's Lucie-7B parallelism experiments (CSV) -> rows ------------------------

LUCIE_DIR = Path(__file__).resolve().parent / "data" / "lucie"
LUCIE_REPO = "github:OpenLLM-France/Lucie-Training"
LUCIE_COMMIT = "c3b8b3a013a32d0a468cd5d6c7bf969a131590c6"
LUCIE_PATH = "chronicles/parallelism/scripts/expe_parallelism/expe_summary.csv"
LUCIE_FILE, LUCIE_BLOB = "expe_summary.csv", "d103a118fc9a9a6d4ea9e9ac62dfafd7f7819f0a"
"""The copy's upstream path and git blob (the same blob as training/expe_parallelism/ at
b2224498dd49, where the table was added)."""
LUCIE_SOURCE = "Lucie-7B parallelism (OpenLLM-France)"
LUCIE_SOURCES = frozenset({LUCIE_SOURCE})
LUCIE_COLUMNS = (
    "", "expe", "filename", "slurm_id", "vocab_size", "nodes", "nGPUs", "tp", "pp", "dp", "z",
    "gbz", "mbz", "num_microbatch", "num_iterations", "TFLOPs", "samples_per_seconds",
    "token_per_second", "estimated_time",
)
LUCIE_SEQ = 4096
LUCIE_EXPERIMENTS = {  # expe -> (vocab column, vocabulary, model name, the run script upstream)
    "1_seq4k": ("32k", 32000, "Lucie-7B (32k vocab)",
                "training/expe_parallelism/1_seq4k/lucie7b-seq4k.slurm @ a440935e5bf5"),
    "2_vocab_65k": ("65k", 65024, "Lucie-7B (65k vocab)",
                    "training/expe_parallelism/2_vocab_65k/lucie7b-v65k.slurm @ a440935e5bf5"),
}
"""The experiments whose script states the whole run. Lines of any other `expe` are left out
(3_recompute_activation: its script is in no commit, so what it recomputed is unknown)."""
LUCIE_RULES = {
    "gpu_type": "A100 80GB SXM (Jean Zay gpu_p5, 8 per node; scripts: --constraint=a100)",
    "gpus_per_node": 8,
    "cluster_label": "jean-zay-a100-80g-2024",
    "inter_node_bytes_per_s_per_gpu": 5.5e9,
    "cluster_notes": "Jean Zay JZ3 A100 partition, as BLOOM's rows: NVLink inside the node, 4 "
                     "OmniPath links per node (bigscience jz/hpc-specs.md); "
                     "inter_node_bytes_per_s_per_gpu = 4 x 100 Gb/s / 8 GPUs = 6.25 GB/s x 0.88 "
                     "(the dgx-a100 preset's 22 of 25 GB/s per HDR NIC); its own label: runs of "
                     "2024 with another software stack",
    "num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 32,
    "ffn_hidden_size": 11008, "ffn_type": "swiglu", "normalization": "RMSNorm",
    "position_embedding": "rope", "tied_embeddings": False, "bias_linear": False,
    "seq_len": LUCIE_SEQ, "vp": None, "sequence_parallel": False,
    "recompute": "none (the script passes no --checkpoint-activations / --recompute-*)",
    "precision": "bf16 (--bf16, DeepSpeed bf16 optimizer: fp32 gradient all-reduce)",
    "flash_attention": True,
    "dropout": False,
    "measured_unit": "global batch / samples_per_seconds (CSV; = gbz x 4096 / token_per_second)",
    "flops_convention": "none (time only)",
    "not_for_calibration": (
        "a setting is missing from the scripts: TP1 PP2 micro-batch 2 ran in 80 GB where the "
        "stated settings need ~90-100 GB (6 runs that ran are predicted not to fit), and each is "
        "predicted at 0.49-0.85 of its time; the scripts also export CUDA_LAUNCH_BLOCKING=1. "
        "Scored and held out like every source, but no constant or interval is fitted on it"),
}
"""What every Lucie row gets that its CSV line does not say (tools/data/lucie/README.md)."""
LUCIE_ZERO = {0: "none (DeepSpeed engine, ZeRO stage 0: gradients all-reduced after the last "
                 "backward, overlap_comm off)"}
"""The CSV's z column -> dp_sharding (every line says 0; no other stage is described)."""


def _lucie_fix() -> str:
    return f"fix: restore the upstream file ({LUCIE_REPO} {LUCIE_PATH} @ {LUCIE_COMMIT[:12]})"


def read_lucie_csv(path: Path) -> list[dict[str, Any]]:
    """The lines of expe_summary.csv, validated, with their line numbers (a one-line PlanError
    naming the file, line, field and value otherwise)."""
    lines = list(csv.reader(Path(path).read_text(encoding="utf-8").splitlines()))
    header = [h.strip() for h in lines[0]] if lines else []
    if header != list(LUCIE_COLUMNS):
        raise PlanError(f"{path.name} line 1: header {header} is not the Lucie table's "
                        f"{list(LUCIE_COLUMNS)}; {_lucie_fix()}")
    texts = ("expe", "filename", "vocab_size")
    reals = ("TFLOPs", "samples_per_seconds", "token_per_second", "estimated_time")
    runs = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        if len(line) != len(header):
            raise PlanError(f"{path.name} line {lineno}: {len(line)} fields, the header has "
                            f"{len(header)}; fix: one value per column {header}")
        run: dict[str, Any] = {"line": lineno}
        for name, text in zip(header, line):
            if name in texts:
                if not text.strip():
                    raise PlanError(f"{path.name} line {lineno}: field {name!r} is empty; "
                                    f"{_lucie_fix()}")
                run[name] = text.strip()
                continue
            run[name or "index"] = csv_number(
                path, lineno, name, text, fix=_lucie_fix(), integral=name not in reals,
                minimum=0 if name in ("", "pp", "z") else 1)  # pp 0: --no-pipeline-parallel
        pp = max(run["pp"], 1)
        checks = (
            ("nGPUs", run["nGPUs"] == 8 * run["nodes"], "8 GPUs x nodes"),
            ("nGPUs", run["nGPUs"] == run["tp"] * pp * run["dp"], "tp x pp x dp (pp 0 as 1)"),
            ("num_microbatch", run["num_microbatch"] * run["mbz"] * run["dp"] == run["gbz"],
             "gbz / (mbz x dp)"),
            ("token_per_second", math.isclose(run["token_per_second"], run["samples_per_seconds"]
                                              * LUCIE_SEQ, rel_tol=1e-6),
             f"samples_per_seconds x {LUCIE_SEQ}"),
        )
        for name, ok, what in checks:
            if not ok:
                raise PlanError(f"{path.name} line {lineno}: field {name!r} = {run[name]} is "
                                f"not {what}; {_lucie_fix()}")
        runs.append(run)
    return runs


def lucie_flops_factor(run: dict[str, Any], vocab: int) -> float:
    """The passes over the weights that the line's TFLOPs implies: Megatron-DeepSpeed logs
    24 c B s l h^2 (1 + s/6h + V/16lh) / (time x GPUs) with c = 3, or 4 when it recomputes
    (--checkpoint-activations / --recompute-granularity), V the vocabulary padded to 128 x TP.
    3 on every kept line: no recompute, and the vocabulary the experiment says."""
    b, s, n_layers, h = (run["gbz"], LUCIE_SEQ, LUCIE_RULES["num_layers"],
                         LUCIE_RULES["hidden_size"])
    pad = 128 * run["tp"]
    padded = -(-vocab // pad) * pad
    flops = 24 * b * s * n_layers * h * h * (1 + s / (6 * h) + padded / (16 * n_layers * h))
    seconds = b / run["samples_per_seconds"]
    return run["TFLOPs"] * 1e12 * seconds * run["nGPUs"] / flops


def lucie_rows(directory: Path | None = None) -> list[dict[str, Any]]:
    """Lucie-7B's measured runs as rows of the published-runs schema: the CSV's own values plus
    LUCIE_RULES, the same for every row; lines of experiments without a script (LUCIE_EXPERIMENTS)
    are left out, and a layout measured more than once is one run at the mean iteration time."""
    path = Path(directory or LUCIE_DIR) / LUCIE_FILE
    by_layout: dict[tuple, list[dict[str, Any]]] = {}
    for run in read_lucie_csv(path):
        if run["expe"] not in LUCIE_EXPERIMENTS:
            continue
        vocab_text = LUCIE_EXPERIMENTS[run["expe"]][0]
        if run["vocab_size"] != vocab_text:
            raise PlanError(f"{path.name} line {run['line']}: field 'vocab_size' = "
                            f"{run['vocab_size']!r} is not {vocab_text!r}, the vocabulary of "
                            f"experiment {run['expe']!r}; {_lucie_fix()}")
        if run["z"] not in LUCIE_ZERO:
            raise PlanError(f"{path.name} line {run['line']}: field 'z' = {run['z']} is not a "
                            f"ZeRO stage these rules describe ({sorted(LUCIE_ZERO)}); "
                            f"{_lucie_fix()}")
        factor = lucie_flops_factor(run, LUCIE_EXPERIMENTS[run["expe"]][1])
        if abs(factor - 3) > 0.01:
            raise PlanError(f"{path.name} line {run['line']}: field 'TFLOPs' = {run['TFLOPs']} "
                            f"is not Megatron-DeepSpeed's figure for this run without recompute "
                            f"(it implies {factor:.3f} passes, not 3); {_lucie_fix()}")
        key = tuple(run[k] for k in ("expe", "nGPUs", "tp", "pp", "dp", "z", "gbz", "mbz"))
        by_layout.setdefault(key, []).append(run)
    rows = []
    for (expe, gpus, tp, pp, dp, z, gbz, mbz), runs in by_layout.items():
        _, vocab, model, script = LUCIE_EXPERIMENTS[expe]
        lines = ", ".join(str(r["line"]) for r in runs)
        stages = "nopp" if pp == 0 else f"pp{pp}"
        rows.append({
            **LUCIE_RULES,
            "id": (f"lucie7b-v{vocab // 1000}k-{runs[0]['line']}-g{gpus}-gbs{gbz}-"
                   f"tp{tp}{stages}dp{dp}-mb{mbz}"),
            "source": LUCIE_SOURCE,
            "source_ref": (f"{LUCIE_REPO} {LUCIE_PATH} @ {LUCIE_COMMIT[:12]}, line {lines} "
                           f"(slurm {', '.join(str(r['slurm_id']) for r in runs)}); run "
                           f"script {script}"),
            "num_gpus": gpus, "model_name": model, "vocab_size": vocab,
            "tp": tp, "pp": max(pp, 1), "dp": dp,
            "deepspeed_pipeline_engine": pp > 0,
            "dp_sharding": LUCIE_ZERO[z],
            "global_batch_size": gbz, "micro_batch_size": mbz,
            "iter_time_s": statistics.fmean(gbz / r["samples_per_seconds"] for r in runs),
            "tflops_per_gpu": statistics.fmean(r["TFLOPs"] for r in runs),
            "repeats": len(runs),
        })
    return rows


def check_lucie_files(directory: Path | None = None) -> list[str]:
    """Files whose bytes differ from the upstream blob recorded in LUCIE_BLOB."""
    return changed_copies(directory or LUCIE_DIR, {LUCIE_FILE: LUCIE_BLOB})


# ---- measured figure -> seconds per iteration ---------------------------------------------


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


# ---- prediction -----------------------------------------------------------------------------


def predict(row: dict[str, Any], plan: ParallelPlan,
            compute: ComputeProfile | None = None) -> dict[str, Any]:
    """Predicted iteration time and peak memory of the plan on the row's cluster (`compute`: the
    calibrated kernel constants, default the cost model's)."""
    cluster = cluster_of(row)
    training = TrainingSpec(
        global_batch_size=plan.global_batch_size, seq_length=plan.seq_length,
        precision=plan.precision, flash_attention=flash_attention_of(row),
        dropout=dropout_of(row),
        allow_zero3=True,
    )
    cm = CostModel(plan.model, cluster, training, compute=compute)
    if "DeepSpeed" in str(row.get("dp_sharding")):
        cm.zero3_live_params = DEEPSPEED_MAX_LIVE_PARAMS
    sums = stage_sums(cm, pp=plan.pp, stages=plan.stages, layers=plan.layers, vocab=plan.vocab,
                      micro_batch_size=plan.micro_batch_size)
    arr = sums.arr
    sync, gather, opt = arr["sync"], arr["gather"], arr["opt"]
    if is_deepspeed_pipeline(row):  # reduction and gather after the last backward, unhidden
        sync, gather, opt = 0.0 * sync, 0.0 * gather, opt + sync + gather
    pipe = one_f_one_b(arr["f"], arr["b"], sums.extras.p2p_s, sync, gather,
                       opt, sums.num_microbatches, overlap_slowdown=cm.overlap_slowdown,
                       virtual_stages=virtual_stages_of(row))
    peak = float(arr["mem"].max())
    return {
        "predicted_s": float(pipe.iteration_s),
        "peak_gib": peak / GIB,
        "cap_gib": cm.memory_cap_bytes / GIB,
        "fits": bool(peak <= cm.memory_cap_bytes),
        "num_microbatches": sums.num_microbatches,
    }


# ---- statistics -----------------------------------------------------------------------------


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho with average ranks for ties."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


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
    parts.append(f"mb{micro_batch_of(row)}")
    rc = recompute_of(row)
    if rc != "none":
        parts.append(f"rc:{rc[:3]}")
    return " ".join(parts)


GEMM_EFFICIENCY_GRID = tuple(round(0.64 + 0.02 * i, 2) for i in range(9))
"""Leave-one-source-out refits ComputeProfile.gemm_efficiency (the constant issue 14 calibrated
on these runs; 0.72 shipped) over this grid on all sources but one and scores that one."""


BIG_SWEEP = 8
"""Issue 19's ranking targets (Spearman >= 0.8, top-1 regret <= 5%) apply to sweeps of at least
this many layouts."""


def sweep_key(r: dict[str, Any]) -> tuple[str, str, int, int]:
    """A sweep: layouts of one model on one cluster at one global batch and sequence (and one
    `run_date` where the source says the cluster changed between its days)."""
    cluster = r["cluster"] + (f" {r['run_date']}" if r.get("run_date") else "")
    return (r["model"], cluster, r["global_batch_size"], r["seq_len"])


def ranking(pred: list[float], meas: list[float]) -> dict[str, float]:
    """Spearman, top-1 regret (measured cost of the predicted-best over the measured-best, minus
    1) and the share of pairs (measured not tied) the prediction orders as measured."""
    best = min(range(len(pred)), key=lambda i: pred[i])
    pairs = [(i, j) for i in range(len(pred)) for j in range(i + 1, len(pred))
             if meas[i] != meas[j]]
    right = sum((pred[i] - pred[j]) * (meas[i] - meas[j]) > 0 for i, j in pairs)
    return {
        "spearman": spearman(pred, meas),
        "top1_regret": meas[best] / min(meas) - 1.0,
        "pairs_ordered": right / len(pairs) if pairs else float("nan"),
    }


def baseline_steps(num_microbatches: int, pp: int, num_layers: int) -> float:
    """Issue 19's reference predictor: micro-batch steps of the 1F1B schedule (m + pp - 1) x
    layers per stage, i.e. a fixed cost per layer per micro-batch whatever the layer's size."""
    return float((num_microbatches + pp - 1) * math.ceil(num_layers / pp))


def gpu_s_per_token(row: dict[str, Any]) -> float:
    """GPU-seconds per token of one second of the row's iteration: GPUs / tokens per
    iteration (ranks layouts of one sweep across GPU counts)."""
    return row["num_gpus"] / (row["global_batch_size"] * row["seq_len"])


def sweep_fields(row: dict[str, Any], *, measured_s: float, num_microbatches: int, pp: int,
                 num_layers: int) -> dict[str, Any]:
    """What `sweeps` reads of a row, but the prediction: its sweep (sweep_key), layout, GPUs,
    and the measured and reference-predictor GPU-seconds per token."""
    gpu_token = gpu_s_per_token(row)
    return {
        "source": row["source"], "model": row["model_name"], "gpus": row["num_gpus"],
        "cluster": cluster_label(row), "layout": layout_label(row),
        "run_date": row.get("run_date"),
        "global_batch_size": row["global_batch_size"], "seq_len": row["seq_len"],
        "measured_gpu_s_per_token": measured_s * gpu_token,
        "baseline_gpu_s_per_token": gpu_token * baseline_steps(num_microbatches, pp, num_layers),
    }


def sweeps(results: list[dict[str, Any]], key: str = "predicted_gpu_s_per_token",
           per_gpu_count: bool = False) -> list[dict[str, Any]]:
    """Ranking within every sweep of >= 2 layouts, on GPU-seconds per token (iteration time x
    GPUs / tokens: at one GPU count the same order as iteration time, across GPU counts the cost
    of a token); `baseline`: the same metrics for baseline_steps(). per_gpu_count: a sweep is
    also one GPU count (the layouts a user could pick for the GPUs they have)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((*sweep_key(r), r["gpus"] if per_gpu_count else None), []).append(r)
    out = []
    for (model, cluster, gbs, seq, gpus), members in groups.items():
        if len({(m["layout"], m["gpus"]) for m in members}) < 2:
            continue
        meas = [m["measured_gpu_s_per_token"] for m in members]
        out.append({
            "model": model, "cluster": cluster, "global_batch_size": gbs, "seq_len": seq,
            **({"gpus": gpus} if per_gpu_count else {}),
            "source": members[0]["source"], "layouts": len(members),
            **ranking([m[key] for m in members], meas),
            "baseline": ranking([m["baseline_gpu_s_per_token"] for m in members], meas),
        })
    return out


def meets_targets(sweep: dict[str, Any]) -> bool:
    """Issue 19's ranking targets for a sweep of >= BIG_SWEEP layouts."""
    return sweep["spearman"] >= 0.8 and sweep["top1_regret"] <= 0.05


def sweep_summary(sw: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweeps of >= BIG_SWEEP layouts: how many, median / min Spearman, how many meet the
    targets, and the same for the reference predictor."""
    big = [g for g in sw if g["layouts"] >= BIG_SWEEP]
    if not big:
        return {"sweeps": len(sw), "big_sweeps": 0}
    rho = [g["spearman"] for g in big]
    base = [g["baseline"]["spearman"] for g in big]
    return {
        "sweeps": len(sw), "big_sweeps": len(big),
        "median_spearman": statistics.median(rho), "min_spearman": min(rho),
        "median_top1_regret": statistics.median(g["top1_regret"] for g in big),
        "max_top1_regret": max(g["top1_regret"] for g in big),
        "median_pairs_ordered": statistics.median(g["pairs_ordered"] for g in big),
        "meeting_targets": sum(meets_targets(g) for g in big),
        "baseline_median_spearman": statistics.median(base),
        "baseline_min_spearman": min(base),
        "baseline_meeting_targets": sum(meets_targets(g["baseline"]) for g in big),
    }


def fit_score(pred: list[float], meas: list[float], sources: list[str], train: list[int]
              ) -> float:
    """What the refit minimises: the mean over the training sources of each source's median
    |error|, so every source counts once (1,440 vTrain single-node rows do not outvote the nine
    sources of a few rows each; weighting rows alike, every other held-out source got the
    grid's lowest value from them)."""
    per: dict[str, list[float]] = {}
    for i in train:
        per.setdefault(sources[i], []).append(abs(pred[i] / meas[i] - 1))
    return statistics.fmean(statistics.median(v) for v in per.values())


def calibrates(result: dict[str, Any]) -> bool:
    """Whether a run may set a constant or an interval: not where its source's settings are
    known to be incomplete (`not_for_calibration` on the row says why); such runs are still
    predicted, held out and scored like every other."""
    return not result.get("not_for_calibration")


def leave_one_source_out(results: list[dict[str, Any]], grid_pred: list[list[float]]
                         ) -> dict[str, Any]:
    """Refit gemm_efficiency on all sources but one (lowest fit_score over the grid), score
    the held-out source with it; then the residual table of the intervals built without each
    source, and the share of that source's measured times inside its 90% intervals. Runs that
    do not calibrate (`calibrates`) are held out and scored but train nothing."""
    sources = sorted({r["source"] for r in results})
    meas = [r["measured_s"] for r in results]
    row_source = [r["source"] for r in results]
    per_source, loso_pred = [], [0.0] * len(results)
    for src in sources:
        train = [i for i, r in enumerate(results) if r["source"] != src and calibrates(r)]
        test = [i for i, r in enumerate(results) if r["source"] == src]
        if not train:
            return {}
        scores = [fit_score(g, meas, row_source, train) for g in grid_pred]
        k = min(range(len(scores)), key=lambda j: scores[j])
        for i in test:
            loso_pred[i] = grid_pred[k][i]
            results[i]["loso_gemm_efficiency"] = GEMM_EFFICIENCY_GRID[k]
        per_source.append({"source": src, "rows": len(test),
                           "gemm_efficiency": GEMM_EFFICIENCY_GRID[k],
                           "median_abs_error": statistics.median(
                               abs(loso_pred[i] / meas[i] - 1) for i in test)})
    residuals = [(r["features"], math.log(meas[i] / loso_pred[i])) for i, r in enumerate(results)]
    inside, widths = [0] * len(results), [0.0] * len(results)
    for entry in per_source:
        src = entry["source"]
        train = [residuals[i] for i, r in enumerate(results)
                 if r["source"] != src and calibrates(r)]
        table = iv.build_table(train)
        hits = []
        for i, r in enumerate(results):
            if r["source"] != src:
                continue
            lo, hi, _ = iv.log_bounds(table, r["features"])
            inside[i] = int(lo <= residuals[i][1] <= hi)
            widths[i] = math.exp(hi) - math.exp(lo)
            hits.append(inside[i])
        entry["interval_coverage"] = statistics.fmean(hits)
    for i, r in enumerate(results):
        r["loso_predicted_s"] = loso_pred[i]
        r["loso_log_residual"] = residuals[i][1]
        r["loso_interval_hit"] = bool(inside[i])
    errors = [abs(loso_pred[i] / meas[i] - 1) for i in range(len(results))]
    held = [{**r, "predicted_gpu_s_per_token": r["loso_predicted_s"]
             * r["measured_gpu_s_per_token"] / r["measured_s"]} for r in results]
    groups = {}
    for name, keep in (("vTrain", lambda r: r["source"] in VTRAIN_SOURCES),
                       ("Lucie-7B", lambda r: r["source"] in LUCIE_SOURCES),
                       ("papers and READMEs",
                        lambda r: r["source"] not in VTRAIN_SOURCES | LUCIE_SOURCES)):
        idx = [i for i, r in enumerate(results) if keep(r)]
        if idx:
            groups[name] = {"rows": len(idx),
                            "median_abs_error": statistics.median(errors[i] for i in idx),
                            "interval_coverage": statistics.fmean(inside[i] for i in idx)}
    return {
        "sources": per_source,
        "by_group": groups,
        "median_abs_error": statistics.median(errors),
        "mean_abs_error": statistics.fmean(errors),
        "interval_coverage": statistics.fmean(inside),
        "interval_median_width": statistics.median(widths),
        "sweeps": sweeps(held),
        "sweeps_one_gpu_count": sweeps(held, per_gpu_count=True),
    }


def residual_file(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The interval's residual table (planner/cost/interval.py) with the runs it came from: per
    run its id, source, features (in the order of `features`), the gemm_efficiency fitted
    without its source and log(measured / predicted) with it. Runs that do not calibrate
    (`calibrates`) are left out."""
    results = [r for r in results if calibrates(r)]
    return {
        "about": "log(measured / predicted) of published A100 runs, each predicted with "
                 "gemm_efficiency fitted on the other sources (leave-one-source-out), grouped "
                 "by feature; read by megatron_ext/planner/cost/interval.py. Written by "
                 "`python tools/bench_published.py --write-residuals "
                 "megatron_ext/planner/cost/residuals_a100.json`; do not edit by hand.",
        "features": list(iv.FEATURES),
        "quantiles": [iv.LOW_Q, iv.HIGH_Q],
        "run_fields": ["id", "source", "features", "gemm_efficiency", "log_residual"],
        "runs": [[r["id"], r["source"], [r["features"][f] for f in iv.FEATURES],
                  r["loso_gemm_efficiency"], round(r["loso_log_residual"], 6)] for r in results],
        "table": iv.build_table([(r["features"], r["loso_log_residual"]) for r in results]),
    }


def residual_text(data: dict[str, Any]) -> str:
    """The residual file as JSON with one run per line (1,630 runs: a third of the indented
    size, and the package reads it whole)."""
    head = json.dumps({k: v for k, v in data.items() if k not in ("runs", "table")}, indent=1)
    runs = ",\n".join("  " + json.dumps(r) for r in data["runs"])
    return (head[:-2] + ',\n "runs": [\n' + runs + '\n ],\n "table": '
            + json.dumps(data["table"], indent=1).replace("\n", "\n ") + "\n}\n")


def model_summaries(results: list[dict[str, Any]], sw: list[dict[str, Any]],
                    held_sw: list[dict[str, Any]], sw_gpus: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """One line per model of the sources summarised rather than listed (VTRAIN_SOURCES): its
    rows' error and its sweeps' ranking, with the reference predictor's and held out."""
    out = []
    keys = sorted({(r["source"], r["model"]) for r in results if r["source"] in VTRAIN_SOURCES},
                  key=lambda k: (k[0], float(k[1].split()[1].rstrip("B"))))
    for source, model in keys:
        members = [r for r in results if (r["source"], r["model"]) == (source, model)]
        ratios = [r["ratio"] for r in members]
        entry = {"source": source, "model": model, "rows": len(members),
                 "median_abs_error": statistics.median(abs(x - 1) for x in ratios),
                 "median_ratio": statistics.median(ratios),
                 "min_ratio": min(ratios), "max_ratio": max(ratios),
                 "memory_false_negatives": sum(not r["fits"] for r in members),
                 **sweep_summary([g for g in sw if (g["source"], g["model"]) == (source, model)])}
        entry["one_gpu_count"] = sweep_summary(
            [g for g in sw_gpus if (g["source"], g["model"]) == (source, model)])
        held = sweep_summary([g for g in held_sw if (g["source"], g["model"]) == (source, model)])
        if held.get("big_sweeps"):
            entry["held_out_median_spearman"] = held["median_spearman"]
            entry["held_out_meeting_targets"] = held["meeting_targets"]
        out.append(entry)
    return out


def run(rows: list[dict[str, Any]], *, loso: bool = True) -> dict[str, Any]:
    """Every row predicted once per gemm_efficiency of the grid (the shipped value's prediction
    is the grid's, not a second one); the held-out refits reuse these predictions."""
    default = ComputeProfile()
    profiles = ([dataclasses.replace(default, gemm_efficiency=g) for g in GEMM_EFFICIENCY_GRID]
                if loso and len({r["source"] for r in rows}) > 1 else [])
    shipped = profiles.index(default) if default in profiles else None
    results: list[dict[str, Any]] = []
    grid_pred: list[list[float]] = [[] for _ in profiles]
    for row in rows:
        plan = build_plan(row)
        measured, how = measured_iteration_s(row)
        preds = [predict(row, plan, c) for c in profiles]
        for k, p in enumerate(preds):
            grid_pred[k].append(p["predicted_s"])
        pred = preds[shipped] if shipped is not None else predict(row, plan)
        fields = sweep_fields(row, measured_s=measured, num_microbatches=pred["num_microbatches"],
                              pp=plan.pp, num_layers=plan.model.num_layers)
        results.append({
            "id": row["id"], **fields,
            "features": iv.plan_features(num_gpus=row["num_gpus"],
                                         micro_batch_size=iv.replica_micro_batch(plan),
                                         pp=plan.pp,
                                         precision=plan.precision, cluster=cluster_label(row)),
            "not_for_calibration": row.get("not_for_calibration"),
            "measured_s": measured, "measured_from": how, **pred,
            "ratio": pred["predicted_s"] / measured,
            "predicted_gpu_s_per_token": pred["predicted_s"] * gpu_s_per_token(row),
            "grid_predicted_s": [p["predicted_s"] for p in preds],
        })
    errors = [abs(r["ratio"] - 1) for r in results]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["source"], r["model"]), []).append(r)
    rank = []
    for (source, model), members in groups.items():
        if len({m["layout"] for m in members}) < 2:
            continue
        rank.append({
            "source": source, "model": model, "rows": len(members),
            "spearman": spearman([m["predicted_gpu_s_per_token"] for m in members],
                                 [m["measured_gpu_s_per_token"] for m in members]),
        })
    held_out: dict[str, Any] = {}
    if profiles:
        held_out = leave_one_source_out(results, grid_pred)
    sw, sw_gpus = sweeps(results), sweeps(results, per_gpu_count=True)
    held_sw = held_out.get("sweeps", [])
    by_source = {src: sweep_summary([g for g in sw if g["source"] == src])
                 for src in sorted({g["source"] for g in sw})}
    by_source_gpus = {src: sweep_summary([g for g in sw_gpus if g["source"] == src])
                      for src in sorted({g["source"] for g in sw_gpus})}
    return {
        "rows": results,
        "sweep_summary": {
            "all": sweep_summary(sw), "held_out": sweep_summary(held_sw), "by_source": by_source,
            "one_gpu_count": sweep_summary(sw_gpus),
            "one_gpu_count_held_out": sweep_summary(held_out.get("sweeps_one_gpu_count", [])),
            "one_gpu_count_by_source": by_source_gpus,
        },
        "model_summaries": model_summaries(results, sw, held_sw, sw_gpus),
        "summary": {
            "rows": len(results),
            "median_abs_error": statistics.median(errors) if errors else float("nan"),
            "mean_abs_error": statistics.fmean(errors) if errors else float("nan"),
            "within_15pct": sum(e <= 0.15 for e in errors),
            "optimistic": sum(r["ratio"] < 1 for r in results),
            "pessimistic": sum(r["ratio"] > 1 for r in results),
            "median_ratio": statistics.median(r["ratio"] for r in results) if results else 1.0,
            "memory_false_negatives": [r["id"] for r in results if not r["fits"]],
            "min_group_spearman": min((g["spearman"] for g in rank), default=float("nan")),
            "min_sweep_spearman": min((g["spearman"] for g in sw), default=float("nan")),
            "max_sweep_top1_regret": max((g["top1_regret"] for g in sw), default=float("nan")),
            "min_big_sweep_spearman": min((g["spearman"] for g in sw if g["layouts"] >= BIG_SWEEP),
                                          default=float("nan")),
            "max_big_sweep_top1_regret": max(
                (g["top1_regret"] for g in sw if g["layouts"] >= BIG_SWEEP), default=float("nan")),
            "loso_median_abs_error": held_out.get("median_abs_error", float("nan")),
            "loso_interval_coverage": held_out.get("interval_coverage", float("nan")),
        },
        "rank_groups": rank,
        "sweeps": sw,
        "sweeps_one_gpu_count": sw_gpus,
        "leave_one_source_out": held_out,
    }


def _sweep_cols(m: dict[str, Any]) -> str:
    """n, median rho, meeting, reference median rho, reference meeting (27 characters)."""
    if not m.get("big_sweeps"):
        return f"{0:3d} {'-':>5} {'-':>4} {'-':>5} {'-':>4}"
    return (f"{m['big_sweeps']:3d} {m['median_spearman']:5.2f} {m['meeting_targets']:4d} "
            f"{m['baseline_median_spearman']:5.2f} {m['baseline_meeting_targets']:4d}")


def print_report(out: dict[str, Any]) -> None:
    print(f"{'run':32} {'layout':34} {'meas s':>8} {'pred s':>8} {'pred/meas':>9} "
          f"{'mem GiB':>8} {'fits':>4}")
    for r in out["rows"]:
        if r["source"] in VTRAIN_SOURCES:
            continue
        print(f"{r['id']:32} {r['layout']:34} {r['measured_s']:8.2f} {r['predicted_s']:8.2f} "
              f"{r['ratio']:9.3f} {r['peak_gib']:8.1f} {'yes' if r['fits'] else 'NO':>4}")
    print()
    print(f"{'source':54} {'model':24} {'rows':>4} {'spearman':>8}")
    for g in out["rank_groups"]:
        if g["source"] in VTRAIN_SOURCES:
            continue
        print(f"{g['source'][:54]:54} {g['model'][:24]:24} {g['rows']:4d} {g['spearman']:8.3f}")
    print()
    held_sweeps = {(g["model"], g["cluster"], g["global_batch_size"], g["seq_len"]): g
                   for g in out["leave_one_source_out"].get("sweeps", [])}
    print(f"{'sweep (model, cluster [date], global batch, seq)':66} {'n':>3} {'spearman':>8} "
          f"{'top1 regret':>11} {'pairs ok':>8} {'held out: rho / regret':>22}")
    for g in out["sweeps"]:
        if g["source"] in VTRAIN_SOURCES:
            continue
        name = f"{g['model']}, {g['cluster']}, {g['global_batch_size']}, {g['seq_len']}"
        h = held_sweeps.get((g["model"], g["cluster"], g["global_batch_size"], g["seq_len"]))
        held = f"{h['spearman']:.3f} / {100 * h['top1_regret']:.1f}%" if h else "-"
        print(f"{name[:66]:66} {g['layouts']:3d} {g['spearman']:8.3f} "
              f"{100 * g['top1_regret']:10.1f}% {100 * g['pairs_ordered']:7.0f}% {held:>22}")
    if out["model_summaries"]:
        print()
        print(f"per model (every sweep in --json): sweeps of >= {BIG_SWEEP} layouts (n), median "
              "Spearman, how many meet rho >= 0.8 and top-1 regret <= 5%,")
        print("and the same for the reference predictor (micro-batch steps x layers per stage); "
              "sweeps as above (GPU counts together, per token) and at one GPU count")
        print(f"{'':63} | {'sweeps':^23} {'held':>5} | {'at one GPU count':^23}")
        cols = f"{'n':>3} {'rho':>5} {'meet':>4} {'ref':>5} {'meet':>4}"
        print(f"{'source':18} {'model':22} {'rows':>4} {'|err|':>5} {'pred/meas':>10} | "
              f"{cols} {'rho':>5} | {cols}")
        for m in out["model_summaries"]:
            held = m.get("held_out_median_spearman")
            print(f"{m['source'][:18]:18} {m['model'][:22]:22} {m['rows']:4d} "
                  f"{100 * m['median_abs_error']:4.0f}% "
                  f"{m['min_ratio']:4.2f}-{m['max_ratio']:<5.2f} | {_sweep_cols(m)} "
                  f"{'-' if held is None else f'{held:.2f}':>5} | "
                  f"{_sweep_cols(m['one_gpu_count'])}")
    print()
    print(f"sweeps of >= {BIG_SWEEP} layouts: n, median / min Spearman, meeting both targets; the "
          "reference predictor (micro-batch steps x layers per stage): median / min, meeting")
    summ = out["sweep_summary"]
    for label, (every, held_out, by_source) in (
            ("", ("all", "held_out", "by_source")),
            (" (at one GPU count)", ("one_gpu_count", "one_gpu_count_held_out",
                                     "one_gpu_count_by_source"))):
        groups = [(f"all sources{label}", summ[every]), (f"all, held out{label}", summ[held_out]),
                  *((f"{k}{label}", v) for k, v in summ[by_source].items())]
        for name, g in groups:
            if not g.get("big_sweeps"):
                continue
            print(f"  {name[:66]:66} {g['big_sweeps']:3d}  rho {g['median_spearman']:6.3f} / "
                  f"{g['min_spearman']:6.3f}  meet {g['meeting_targets']:3d}   reference "
                  f"{g['baseline_median_spearman']:6.3f} / {g['baseline_min_spearman']:6.3f}  "
                  f"meet {g['baseline_meeting_targets']:3d}")
    held = out["leave_one_source_out"]
    if held:
        print()
        print(f"{'held-out source (gemm_efficiency fitted on the others)':58} {'rows':>4} "
              f"{'eff':>5} {'|error|':>7} {'in 90%':>6}")
        for e in held["sources"]:
            print(f"{e['source'][:58]:58} {e['rows']:4d} {e['gemm_efficiency']:5.2f} "
                  f"{100 * e['median_abs_error']:6.1f}% {100 * e['interval_coverage']:5.0f}%")
        print(f"leave-one-source-out: median |error| {100 * held['median_abs_error']:.1f}%, "
              f"mean {100 * held['mean_abs_error']:.1f}%; 90% interval coverage on held-out "
              f"sources {100 * held['interval_coverage']:.0f}% (median width "
              f"{100 * held['interval_median_width']:.0f}% of the prediction)")
        for name, g in held["by_group"].items():
            print(f"  {name} ({g['rows']} rows): median |error| "
                  f"{100 * g['median_abs_error']:.1f}%, "
                  f"coverage {100 * g['interval_coverage']:.0f}%")
        worst = [g for g in held["sweeps"]]
        if worst:
            print(f"held-out sweeps: min Spearman "
                  f"{min(g['spearman'] for g in worst):.3f}, max top-1 regret "
                  f"{100 * max(g['top1_regret'] for g in worst):.1f}%")
        big = [g for g in worst if g["layouts"] >= BIG_SWEEP]
        if big:
            print(f"held-out sweeps of >= {BIG_SWEEP} layouts ({len(big)}): min Spearman "
                  f"{min(g['spearman'] for g in big):.3f}, max top-1 regret "
                  f"{100 * max(g['top1_regret'] for g in big):.1f}%")
    s = out["summary"]
    print()
    print(f"rows {s['rows']}  median |error| {100 * s['median_abs_error']:.1f}%  "
          f"mean |error| {100 * s['mean_abs_error']:.1f}%  within 15%: {s['within_15pct']}  "
          f"optimistic {s['optimistic']} / pessimistic {s['pessimistic']} "
          f"(median pred/meas {s['median_ratio']:.3f})")
    print(f"memory false negatives: {len(s['memory_false_negatives'])} "
          f"{' '.join(s['memory_false_negatives'])}")
    print(f"min Spearman within a source's layouts of one model: {s['min_group_spearman']:.3f}")
    print(f"sweeps: min Spearman {s['min_sweep_spearman']:.3f}, max top-1 regret "
          f"{100 * s['max_sweep_top1_regret']:.1f}%; of >= {BIG_SWEEP} layouts: min Spearman "
          f"{s['min_big_sweep_spearman']:.3f}, max top-1 regret "
          f"{100 * s['max_big_sweep_top1_regret']:.1f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DEFAULT_DATA, help="published runs JSON")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--rows", nargs="*", default=None, help="only these row ids")
    p.add_argument("--no-loso", action="store_true",
                   help="skip the leave-one-source-out refit (9 predictions per row)")
    p.add_argument("--write-residuals", default=None, metavar="PATH",
                   help="write the intervals' residual table here (all rows, with the "
                   "leave-one-source-out refit): megatron_ext/planner/cost/residuals_a100.json")
    p.add_argument("--vtrain-dir", default=str(VTRAIN_DIR),
                   help="vTrain's measured CSVs (ground_truth_single.csv, ground_truth_multi.csv)")
    p.add_argument("--no-vtrain", action="store_true",
                   help="leave out the vTrain rows")
    p.add_argument("--lucie-dir", default=str(LUCIE_DIR),
                   help="OpenLLM-France's Lucie-7B parallelism table (expe_summary.csv)")
    p.add_argument("--no-lucie", action="store_true",
                   help="leave out the Lucie-7B rows")
    args = p.parse_args(argv)
    data = json.loads(Path(args.data).read_text())
    rows = data["rows"]
    sources = (
        (args.no_vtrain, args.vtrain_dir, VTRAIN_DIR, check_vtrain_files, vtrain_rows,
         f"the upstream files ({VTRAIN_REPO} @ {VTRAIN_COMMIT[:12]})"),
        (args.no_lucie, args.lucie_dir, LUCIE_DIR, check_lucie_files, lucie_rows,
         f"the upstream file ({LUCIE_REPO} {LUCIE_PATH} @ {LUCIE_COMMIT[:12]})"),
    )
    for skip, directory, shipped, check, load, upstream in sources:
        if skip:
            continue
        try:
            damaged = Path(directory).resolve() == shipped and check()
            if damaged:
                raise PlanError(f"{shipped}: {', '.join(damaged)} differ from {upstream}; fix: "
                                "restore them (README.md there)")
            rows = rows + load(Path(directory))
        except (PlanError, OSError) as err:
            print(f"bench_published: {err}", file=sys.stderr)
            return 2
    if args.rows:
        unknown = set(args.rows) - {r["id"] for r in rows}
        if unknown:
            print(f"--rows: unknown id(s) {sorted(unknown)}", file=sys.stderr)
            return 2
        rows = [r for r in rows if r["id"] in args.rows]
    if args.write_residuals and (args.rows or args.no_loso or args.no_vtrain):
        print("--write-residuals needs every row and the refit: drop --rows / --no-loso / "
              "--no-vtrain", file=sys.stderr)
        return 2
    wall, cpu = time.perf_counter(), time.process_time()
    out = run(rows, loso=not args.no_loso)
    out["timing"] = {"rows": len(rows), "wall_s": time.perf_counter() - wall,
                     "cpu_s": time.process_time() - cpu}
    print_report(out)
    print(f"{len(rows)} rows in {out['timing']['wall_s']:.1f} s wall, "
          f"{out['timing']['cpu_s']:.1f} s CPU")
    if args.write_residuals:
        Path(args.write_residuals).write_text(residual_text(residual_file(out["rows"])))
        print(f"wrote {args.write_residuals}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
