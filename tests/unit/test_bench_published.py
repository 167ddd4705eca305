"""tools/bench_published.py runs end to end on two published rows (the benchmark itself is not
a test: its targets are recorded in docs/benchmarks.md). The rows are copied from SC'21 Table 2
(Narayanan et al., arXiv:2104.04473): the same 174.6B model on 1,536 A100s as PTD-P and as
DeepSpeed ZeRO-3."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.calibration.ranking import ranking
from megatron_ext.calibration.residuals import GEMM_EFFICIENCY_GRID, fit_score
from megatron_ext.calibration.rows import build_plan, cluster_of, measured_iteration_s
from megatron_ext.calibration.scoring import predict, run
from megatron_ext.calibration.sources import DEFAULT_DATA, FP8_DATA
from megatron_ext.calibration.vtrain import VTRAIN_SOURCES, vtrain_rows

TOOLS = Path(__file__).resolve().parents[2] / "tools"

ROWS = [
    {
        "id": "sc21-t2-PTD-174.6B-1536",
        "source": "Narayanan et al. SC'21 Table 2",
        "gpu_type": "A100 80GB SXM (DGX A100, Selene)",
        "num_gpus": 1536,
        "gpus_per_node": 8,
        "model_name": "GPT 174.6B",
        "num_layers": 96,
        "hidden_size": 12288,
        "num_heads": 96,
        "ffn_hidden_size": 49152,
        "vocab_size": 51200,
        "seq_len": 2048,
        "tp": 8,
        "pp": 12,
        "vp": None,
        "dp": 16,
        "sequence_parallel": None,
        "dp_sharding": "none (plain DP)",
        "global_batch_size": 1536,
        "micro_batch_size": 1,
        "recompute": "full (eq.3 convention)",
        "precision": "mixed fp16",
        "tflops_per_gpu": 141,
        "iter_time_s": None,
        "tokens_per_s_total": None,
        "tokens_per_s_per_gpu": None,
        "measured_unit": "achieved TFLOP/s per GPU (eq.3, incl. recompute FLOPs)",
        "flops_convention": "eq.(3) as Table 1",
        "derived_iter_time_s": 20.829
    },
    {
        "id": "sc21-t2-ZeRO-3-174.6B-1536",
        "source": "Narayanan et al. SC'21 Table 2",
        "gpu_type": "A100 80GB SXM (DGX A100, Selene)",
        "num_gpus": 1536,
        "gpus_per_node": 8,
        "model_name": "GPT 174.6B",
        "num_layers": 96,
        "hidden_size": 12288,
        "num_heads": 96,
        "ffn_hidden_size": 49152,
        "vocab_size": 51200,
        "seq_len": 2048,
        "tp": 1,
        "pp": 1,
        "vp": None,
        "dp": 1536,
        "sequence_parallel": None,
        "dp_sharding": "ZeRO-3 (DeepSpeed), no model parallelism",
        "global_batch_size": 1536,
        "micro_batch_size": 1,
        "recompute": "full (eq.3 convention)",
        "precision": "mixed fp16",
        "tflops_per_gpu": 44,
        "iter_time_s": None,
        "tokens_per_s_total": None,
        "tokens_per_s_per_gpu": None,
        "measured_unit": "achieved TFLOP/s per GPU (eq.3, incl. recompute FLOPs)",
        "flops_convention": "eq.(3) as Table 1",
        "derived_iter_time_s": 66.746
    }
]



def test_bench_published_two_rows(tmp_path):
    data = tmp_path / "runs.json"
    data.write_text(json.dumps({"about": "two rows", "rows": ROWS}))
    out_path = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(TOOLS / "bench_published.py"), "--data", str(data), "--json",
         str(out_path), "--no-vtrain"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(out_path.read_text())
    by_id = {r["id"]: r for r in out["rows"]}
    for row in ROWS:
        # The measured TFLOP/s converts back to the iteration time the data file derives from
        # the same eq. (3) (rounded there to 3 decimals).
        assert by_id[row["id"]]["measured_s"] == pytest.approx(row["derived_iter_time_s"], rel=1e-3)
        assert by_id[row["id"]]["fits"]
    ptd, z3 = by_id["sc21-t2-PTD-174.6B-1536"], by_id["sc21-t2-ZeRO-3-174.6B-1536"]
    # Measured 20.8 s vs 66.7 s: ZeRO-3's per-layer traffic over 192 nodes dominates.
    assert z3["predicted_s"] > 2 * ptd["predicted_s"]
    assert out["rank_groups"][0]["rows"] == 2
    assert "median |error|" in done.stdout


def test_ranking_metrics_by_hand():
    # predicted order 0 < 1 < 2, measured 0 < 2 < 1: pairs (0,1) (0,2) right, (1,2) wrong.
    r = ranking([1.0, 2.0, 3.0], [1.0, 3.0, 2.0])
    assert r["spearman"] == pytest.approx(0.5)
    assert r["top1_regret"] == 0.0
    assert r["pairs_ordered"] == pytest.approx(2 / 3)
    # the predicted-best layout measured 1.1x the measured-best one: 10% regret
    r = ranking([1.0, 2.0], [1.1, 1.0])
    assert r["top1_regret"] == pytest.approx(0.1)
    assert r["pairs_ordered"] == 0.0


def test_sweep_metrics_and_leave_one_source_out(tmp_path):
    """The two SC'21 rows are one sweep (same model, cluster, batch, sequence); a third, copied
    into another source, lets every source be held out once."""
    other = dict(ROWS[0], id="copy-PTD", source="a second source")
    out = run(ROWS + [other])
    (sweep,) = out["sweeps"]
    assert sweep["layouts"] == 3 and sweep["top1_regret"] == 0.0
    held = out["leave_one_source_out"]
    assert {e["source"] for e in held["sources"]} == {ROWS[0]["source"], "a second source"}
    for e in held["sources"]:
        assert e["gemm_efficiency"] in GEMM_EFFICIENCY_GRID
    for r in out["rows"]:  # the held-out prediction is one of the grid's predictions
        assert r["loso_predicted_s"] > 0
    assert 0.0 <= held["interval_coverage"] <= 1.0


def _all_rows():
    return json.loads(Path(DEFAULT_DATA).read_text())["rows"] + vtrain_rows()


def test_residual_file_is_the_tools_output():
    """The shipped residual table is what build_table makes of the runs stored beside it (so it
    was written by `bench_published.py --write-residuals`, not edited by hand), one run per
    published row and vTrain run."""
    from megatron_ext.planner.cost import interval as iv

    data = json.loads(iv.TABLE_PATH.read_text())
    assert data["run_fields"] == ["id", "source", "features", "gemm_efficiency", "log_residual"]
    runs = [(dict(zip(data["features"], r[2])), r[4], r[1]) for r in data["runs"]]
    rebuilt = iv.build_table(runs)
    assert [r[0] for r in data["runs"]] == [r["id"] for r in _all_rows()]
    assert rebuilt["runs"] == data["table"]["runs"] == len(data["runs"])
    for feature, groups in rebuilt["groups"].items():
        for name, g in groups.items():
            stored = data["table"]["groups"][feature][name]
            assert stored["runs"] == g["runs"]
            assert stored["low"] == pytest.approx(g["low"], abs=1e-5)
            assert stored["high"] == pytest.approx(g["high"], abs=1e-5)
    assert data["table"]["sources"]["median"] == pytest.approx(
        rebuilt["sources"]["median"], abs=1e-5)


def test_residual_file_matches_the_cost_model():
    """The shipped residuals are the current cost model's held-out errors: every published row
    and every 16th vTrain run, predicted at the gemm_efficiency fitted without its source (stored
    with it), gives the stored residual. A change to the cost model that moves them must
    regenerate the file (the message says how); the full refit takes ~30 s, too long here."""
    import dataclasses

    from megatron_ext.planner.cost import interval as iv
    from megatron_ext.planner.cost.compute import ComputeProfile

    rows = _all_rows()
    shipped = json.loads(iv.TABLE_PATH.read_text())["runs"]
    assert [r[0] for r in shipped] == [r["id"] for r in rows]
    vtrain = [i for i, r in enumerate(rows) if r["source"] in VTRAIN_SOURCES]
    sample = [i for i, r in enumerate(rows) if r["source"] not in VTRAIN_SOURCES]
    sample += vtrain[::16]
    stale = []
    for i in sample:
        row, (_, _, _, eff, stored) = rows[i], shipped[i]
        compute = dataclasses.replace(ComputeProfile(), gemm_efficiency=eff)
        pred = predict(row, build_plan(row), compute)["predicted_s"]
        fresh = math.log(measured_iteration_s(row)[0] / pred)
        if abs(fresh - stored) > 1e-4:
            stale.append(f"{row['id']}: {stored:.4f} -> {fresh:.4f}")
    assert len(sample) > 170 and not stale, (
        "the cost model's held-out errors moved; run `python tools/bench_published.py "
        f"--write-residuals megatron_ext/planner/cost/residuals_a100.json`: {stale[:5]}"
    )


def test_refit_counts_every_source_once():
    """The held-out refit minimises the mean of the training sources' median |error|: a source
    of many rows weighs as much as one of a single row."""
    meas = [1.0] * 101
    pred = [2.0] * 100 + [1.1]  # source a: 100 rows 100% off; source b: 1 row 10% off
    sources = ["a"] * 100 + ["b"]
    assert fit_score(pred, meas, sources, list(range(101))) == pytest.approx(0.55)
    assert fit_score(pred, meas, sources, [100]) == pytest.approx(0.1)


def test_deepspeed_pipeline_and_stated_network_rows():
    """A BLOOM topology-search row (Megatron-DeepSpeed, DeepSpeed ZeRO-1, Jean Zay's 4 NICs per
    node): zero=1 layers; its gradient reduction is unhidden, as Megatron-LM's by default (the
    same run priced as Megatron-LM with --overlap-grad-reduce --overlap-param-gather is
    faster, without them the same); the stated inter-node bandwidth replaces the preset's (the
    DGX network is faster again); its cluster label and run date make it its own sweep."""
    rows = json.loads(Path(DEFAULT_DATA).read_text())["rows"]
    row = next(r for r in rows if r["id"] == "bloom-prequel-181B-tp4pp6dp16-mb2-gbs2048")
    plan = build_plan(row)
    assert {layer.zero for layer in plan.layers} == {1}
    assert cluster_of(row).inter_node.bandwidth_bytes_per_s == 5.5e9
    deepspeed = predict(row, plan)["predicted_s"]
    megatron = dict(row, dp_sharding="ZeRO-1 (distributed optimizer)")
    assert predict(megatron, plan)["predicted_s"] == pytest.approx(deepspeed)
    overlapped = dict(megatron, overlap_grad_reduce=True, overlap_param_gather=True)
    assert predict(overlapped, plan)["predicted_s"] < deepspeed
    dgx = {k: v for k, v in row.items() if k not in ("inter_node_bytes_per_s_per_gpu",
                                                      "cluster_label")}
    assert predict(dgx, plan)["predicted_s"] < deepspeed
    earlier = dict(row, id="same layout, other day", run_date="2022-02-21")
    out = run([row, earlier], loso=False)
    assert out["rows"][0]["cluster"] == "jean-zay-a100-80g"
    assert out["sweeps"] == []  # one layout per (model, cluster, date, batch, seq)


def test_reported_memory_reads_the_quoted_mem_column():
    """BigScience's tr11 rows quote their table's header and row; the Mem cell is the per-GPU
    memory the source reports, compared (not fitted) with the predicted peak."""
    from megatron_ext.calibration.scoring import quoted_memory_gb, reported_memory

    rows = json.loads(Path(DEFAULT_DATA).read_text())["rows"]
    row = next(r for r in rows if r["id"] == "bloom-prequel-181B-tp8pp2dp24-mb1-gbs2016")
    assert quoted_memory_gb(row) == 65.0  # "| 65GB | 145.45 | 109.11 | 02-25 |"
    assert quoted_memory_gb(ROWS[0]) is None  # SC'21 reports no memory
    with_mem = [r for r in rows if quoted_memory_gb(r) is not None]
    assert {r["source"] for r in with_mem} == {"BigScience tr11 (BLOOM) prequel topology search"}
    summary = reported_memory([row, ROWS[0]], [{"id": row["id"], "peak_gib": 52.0},
                                               {"id": ROWS[0]["id"], "peak_gib": 70.0}])
    assert summary["rows"] == 1 and summary["median_ratio"] == pytest.approx(0.8)
    assert summary["within_10pct"] == 0


def test_out_of_memory_layouts_are_the_fit_boundary():
    """The layouts BLOOM's tables report as OOM are kept apart from the measured rows, quote
    their table row, carry no measured figure, and are predicted not to fit; the bench reports
    them (the other side of memory_false_negatives)."""
    from megatron_ext.calibration.scoring import out_of_memory_boundary
    from megatron_ext.calibration.sources import load_out_of_memory

    oom = load_out_of_memory()
    assert len(oom) == 3
    ids = {r["id"] for r in json.loads(Path(DEFAULT_DATA).read_text())["rows"]}
    for record in oom:
        assert record["id"] not in ids and record["id"].endswith("-oom")
        assert "| OOM  |" in record["quote"] and "02-25" in record["quote"]
        assert "iter_time_s" not in record and "tflops_per_gpu" not in record
        cells = [c.strip() for c in record["quote"].rsplit("row:", 1)[1].split("|")[1:-1]]
        assert [int(c) for c in cells[2:7]] == [record["dp"], record["tp"], record["pp"],
                                                record["micro_batch_size"],
                                                record["global_batch_size"]]
    boundary = out_of_memory_boundary(oom)
    assert boundary["layouts"] == boundary["predicted_not_to_fit"] == 3
    assert all(r["peak_gib"] > r["cap_gib"] for r in boundary["records"])
    assert load_out_of_memory(FP8_DATA) == []
