"""vTrain's measured layout sweeps (tools/data/vtrain/, README.md there: 1,440 single-node and
109 multi-node Megatron-DeepSpeed runs, the upstream CSVs byte for byte) as rows of the
published-runs schema, one rule for every row: vocabulary 50257, ffn 4h, fp16, no flash
attention, no sequence parallelism, 1F1B, full recompute (the configs' use_checkpoint),
DeepSpeed engine without ZeRO (gradients reduced after the last backward, as vTrain's own
simulator schedules them), A100 80GB with the dgx-a100 network, cluster `vtrain-a100`; a layout
the CSV measured twice is one run at the mean. Their sources are "vTrain single node" and
"vTrain multi node" (two held-out sources).
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

from megatron_ext.calibration.sources import DATA_DIR, changed_copies, csv_number
from megatron_ext.errors import PlanError

VTRAIN_DIR = DATA_DIR / "vtrain"
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


def check_vtrain_files(directory: Path | None = None) -> list[str]:
    """Files whose bytes differ from the upstream blobs recorded in VTRAIN_FILES."""
    return changed_copies(directory or VTRAIN_DIR,
                          {name: blob for name, (_, blob) in VTRAIN_FILES.items()})
