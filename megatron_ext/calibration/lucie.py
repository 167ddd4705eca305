"""OpenLLM-France's Lucie-7B parallelism experiments (tools/data/lucie/, README.md there: the
upstream expe_summary.csv byte for byte, 44 lines of Megatron-DeepSpeed runs on Jean Zay's A100
80GB nodes) as rows of the published-runs schema, one rule for every row from the run scripts:
Llama-style 32 x 4096, FFN 11008 SwiGLU, 32 heads, RoPE, RMSNorm, untied embeddings, no biases,
seq 4096, bf16, flash attention v2, no dropout, no recompute, no sequence parallelism, DeepSpeed
0.12.6 with ZeRO stage 0 and bf16, i.e. its BF16_Optimizer (ZeRO-1's optimizer-state split;
gradients reduced after the last backward, with or without the pipeline engine), synchronous
kernel launches (CUDA_LAUNCH_BLOCKING=1) of the fork's own kernel count, the BLOOM rows' Jean
Zay network as cluster `jean-zay-a100-80g-2024`; vocabulary 32000 (1_seq4k) or 65024
(2_vocab_65k), one model each. The line of 3_recompute_activation (no script) is left out; a
layout measured three times is one run at the mean. Source "Lucie-7B parallelism
(OpenLLM-France)".
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import Any

from megatron_ext.calibration.sources import DATA_DIR, changed_copies, csv_number
from megatron_ext.errors import PlanError

LUCIE_DIR = DATA_DIR / "lucie"
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
LUCIE_RULES: dict[str, Any] = {  # fields of a published row (JSON values)
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
    "kernel_profile": {"host_overlap_power": 1.0, "layer_forward_kernels": 40,
                       "layer_backward_kernels": 94, "layer_extra_elementwise_passes": 33},
    "hardware_notes": (
        "host_overlap_power 1: the scripts export CUDA_LAUNCH_BLOCKING=1 (every launch waits for "
        "its kernel, so host and GPU time add); layer_forward_kernels 40: the layer of "
        "OpenLLM-France/Megatron-DeepSpeed @ fd5c47a counted op by op (tools/data/lucie/"
        "README.md): apex RMSNorm 2, 4 GEMMs, rotary embedding of q and k 10 each, 3 layout "
        "copies before and 1 after flash attention, its cu_seqlens arange and kernel 2, "
        "SiLU and product 2, dropout(p=0) and residual add 2 x 2, and 2 host-to-device copies "
        "(torch.tensor(0.0, device=...) for moe_loss and mlp_bias); layer_backward_kernels 94: "
        "2 x the 38 compute kernels plus DeepSpeed 0.12.6's BF16_Optimizer per micro-batch and "
        "weight tensor (6 per layer): zero the bf16 gradient, cast it to fp32, add it to the "
        "fp32 copy; "
        "layer_extra_elementwise_passes 33 (over [tokens, hidden / tp], beyond the fused "
        "layer's): the rotary embedding's 12 passes over q and over k where a fused kernel "
        "makes 2 (20), SiLU and product apart (2 more over [tokens, ffn / tp]: 5.4), the 4 "
        "layout copies (8)"),
    "not_for_calibration": (
        "the data-parallel reduction across 16-32 nodes runs 2-4x slower than the Jean Zay "
        "network figure these rows use (no 2024 measurement of that network was found), and "
        "the count of kernels and the synchronous launches are this run's own: scored and "
        "held out like every source, but no constant or interval is fitted on it"),
}
"""What every Lucie row gets that its CSV line does not say (tools/data/lucie/README.md)."""
LUCIE_ZERO = {0: "DeepSpeed ZeRO-1 (config stage 0, but DeepSpeed 0.12.6 wraps a bf16 run's "
                 "optimizer in BF16_Optimizer: fp32 master weights and Adam moments split over "
                 "the data-parallel ranks, gradients all-reduced in bf16 after the last "
                 "backward, the bf16 weights all-gathered after the step)"}
"""The CSV's z column -> dp_sharding (every line says 0; no other stage is described). With
bf16 and ZeRO stage 0, DeepSpeed 0.12.6 (what the repository's requirements pin) picks the
BFLOAT16 wrapper (engine.py `_do_optimizer_sanity_check`), whose BF16_Optimizer partitions the
fp32 weights and optimizer state over the data-parallel group like ZeRO-1; the engine reduces
the gradients in `communication_data_type`, bf16 for a bf16 run (the pipeline engine the fp32
buffer cast to it, without it the bf16 `.grad`s), and `step` all-gathers the updated bf16
weights. Bytes moved per parameter: 2 x 2 (bf16 ring all-reduce) + 2
(gather), the same as ZeRO-1's fp32 reduce-scatter (4) + bf16 gather (2) the cost model prices
for zero=1 on DeepSpeed's engine."""


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
