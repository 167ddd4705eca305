"""The published FP8 rows (tools/data/published_runs_fp8.json): each quotes its source and the
numbers it was read from, becomes the flags and cluster the run used, and the FP8 held-out refit
(calibration/fp8_fit.py) scores a source with the efficiency fitted on the others."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

import pytest

from megatron_ext.calibration import fp8_fit
from megatron_ext.calibration.rows import (
    build_plan,
    cluster_of,
    compute_of,
    evaluate_flags,
    megatron_flags,
)
from megatron_ext.calibration.scoring import predict
from megatron_ext.calibration.sources import FP8_DATA, load_published
from megatron_ext.cli import main
from megatron_ext.errors import PlanError
from megatron_ext.planner.cost.compute import ComputeProfile

ROWS = {r["id"]: r for r in load_published(FP8_DATA)}


def test_every_row_quotes_its_source_and_numbers():
    assert len(ROWS) >= 23
    assert len({r["source"] for r in ROWS.values()}) >= 5
    for row in ROWS.values():
        assert row["source"] and row["source_ref"] and row["quote"], row["id"]
        assert row["fp8_format"] in ("e4m3", "hybrid") and row["fp8_recipe"], row["id"]
        if row["source"].startswith("MLPerf"):
            # the measured time is the median of the per-log medians the quote lists
            listed = re.search(r"train_step_time of result_\S+ = ([0-9. /]+) s", row["quote"])
            assert listed, row["id"]
            medians = [float(x) for x in listed.group(1).split(" / ")]
            assert len(medians) == len(row["results"])
            assert row["iter_time_s"] == pytest.approx(statistics.median(medians), abs=1e-4)
            assert any("config_" in c for c in row["config"])
        else:
            # the tokens/s/GPU figure as the table prints it (torchtitan with a thousands comma)
            tps = row["tokens_per_s_per_gpu"]
            assert f"| {tps:,} |" in row["quote"] or f"| {tps} " in row["quote"], row["id"]


def test_an_mlperf_row_becomes_its_flags_and_cluster():
    h100 = ROWS["mlperf50-h100-405b-512"]
    flags = megatron_flags(h100)
    for expected in (["--fp8-format", "e4m3"], ["--fp8-recipe", "delayed"],
                     ["--context-parallel-size", "2"], ["--num-query-groups", "8"],
                     ["--num-virtual-stages-per-pipeline-rank", "8"]):
        i = flags.index(expected[0])
        assert flags[i:i + 2] == expected
    assert "--fp8-param-gather" in flags and "--use-distributed-optimizer" in flags
    plan = build_plan(h100)
    assert (plan.pp, plan.virtual_stages, plan.layers[0].tp, plan.layers[0].cp) == (8, 8, 8, 2)
    gb200 = ROWS["mlperf50-gb200-405b-512"]
    cluster = cluster_of(gb200)
    # 512 GPUs of 4-GPU trays, one 64-GPU model replica per NVL72 rack (row's SEGMENT rule)
    assert (cluster.name, cluster.gpus_per_node, cluster.num_nodes,
            cluster.nvlink_domain_size) == ("gb200-nvl72", 4, 128, 64)


def test_fp8_efficiency_refit_holds_each_source_out():
    """Two sources: each is predicted with the grid value that fits the other best, and its
    interval is built without it."""
    rows = [ROWS["mlperf51-gb200-8b-72"], ROWS["mlperf51-gb300-8b-72"],
            ROWS["torchtitan-h100-8b-128"]]
    out = fp8_fit.fp8_leave_one_source_out(rows)
    assert {s["source"] for s in out["sources"]} == {r["source"] for r in rows}
    by_id = {r["id"]: r for r in out["rows"]}
    for entry in out["sources"]:
        assert entry["fp8_gemm_efficiency"] in fp8_fit.FP8_EFFICIENCY_GRID
        for row in rows:
            if row["source"] != entry["source"]:
                continue
            profile = ComputeProfile(fp8_gemm_efficiency=entry["fp8_gemm_efficiency"])
            expected = predict(row, build_plan(row), profile)["predicted_s"]
            held = by_id[row["id"]]
            assert held["loso_predicted_s"] == pytest.approx(expected)
            assert held["interval_low_s"] < held["loso_predicted_s"] < held["interval_high_s"]
    # the FP8 efficiency reaches the FP8 rows' GEMMs: a higher one predicts faster
    row = ROWS["mlperf51-gb200-8b-72"]
    slow, fast = (predict(row, build_plan(row), ComputeProfile(fp8_gemm_efficiency=e))
                  ["predicted_s"] for e in (0.4, 0.8))
    assert fast < slow


BRIDGE_TP_OVERLAP = "CommOverlapConfig(tp_comm_overlap=True)"
"""What config_inferred quotes of Megatron-Bridge's Llama 70B / 405B pretrain recipes."""


def test_rows_stating_tp_comm_overlap_run_with_the_flag():
    """`tp_comm_overlap` is set exactly where the quoted config says TP_COMM_OVERLAP=True
    (MLPerf) or the recipe the row names turns it on (Megatron-Bridge's 70B / 405B recipes, on
    every layout with TP > 1); the loader passes --tp-comm-overlap and the plan records it."""
    for row in ROWS.values():
        stated = ("TP_COMM_OVERLAP=True" in row["quote"]
                  or BRIDGE_TP_OVERLAP in row.get("config_inferred", ""))
        assert bool(row.get("tp_comm_overlap")) == stated, row["id"]
        assert ("--tp-comm-overlap" in megatron_flags(row)) == stated
        assert build_plan(row).tp_comm_overlap == stated
    assert sum("TP_COMM_OVERLAP=True" in r["quote"] for r in ROWS.values()) == 9
    bridge = [r for r in ROWS.values() if r["source"].startswith("Megatron-Bridge")]
    assert [BRIDGE_TP_OVERLAP in r.get("config_inferred", "") for r in bridge] == [
        int(r["tp"]) > 1 for r in bridge]


def test_interleaved_rows_overlap_their_pipeline_messages():
    """Every FP8 row with virtual stages ran Megatron-Core's interleaved schedule with its
    default overlap_p2p_comm (`overlap_p2p_comm`, evaluate --megatron-p2p-overlap); rows without
    virtual stages cannot overlap them."""
    for row in ROWS.values():
        interleaved = build_plan(row).virtual_stages > 1
        assert bool(row.get("overlap_p2p_comm")) == interleaved, row["id"]
        assert ("--megatron-p2p-overlap" in evaluate_flags(row)) == interleaved


def test_a_row_states_the_gpu_and_kernels_it_ran_on():
    """torchtitan's H100 is a 500 W HBM2e part running PyTorch SDPA's FlashAttention-2: the
    rows state its peaks, memory bandwidth and attention efficiency (hardware_notes says where
    each comes from) and are priced with them, slower than on the dgx-h100 preset."""
    row = ROWS["torchtitan-h100-8b-8"]
    assert all(k in row["hardware_notes"] for k in ("peak_flops", "hbm_bytes_per_s",
                                                    "attention_efficiency", "FlashAttention-2"))
    cluster = cluster_of(row)
    assert (cluster.peak_flops, cluster.peak_fp8_flops) == (912e12, 1824e12)
    compute = compute_of(row, ComputeProfile(fp8_gemm_efficiency=0.55))
    assert compute.fp8_gemm_efficiency == 0.55  # the grid's constant stays
    assert (compute.hbm_bytes_per_s, compute.attention_efficiency,
            compute.attention_backward_efficiency) == (2.4e12, 0.35, 0.286)
    preset = {k: v for k, v in row.items() if k not in ("peak_flops", "peak_fp8_flops",
                                                         "kernel_profile")}
    plan = build_plan(row)
    assert predict(row, plan)["predicted_s"] > predict(preset, plan)["predicted_s"]
    stating = [r for r in ROWS.values() if r.get("kernel_profile") or r.get("peak_flops")]
    assert {r["source"] for r in stating} == {row["source"]}
    assert all(r.get("hardware_notes") for r in stating)
    with pytest.raises(PlanError, match="kernel_profile.attention_eff is not a known field"):
        compute_of({**row, "kernel_profile": {"attention_eff": 0.3}}, ComputeProfile())


@pytest.mark.parametrize("row_id", ["mlperf50-h100-405b-512", "torchtitan-h100-8b-8",
                                    "bridge2511-h100-70b-64"])
def test_fp8_row_prediction_is_what_evaluate_prints(row_id, tmp_path, capsys):
    """The FP8 rows' settings travel as `megatron-ext evaluate` flags (--megatron-p2p-overlap,
    --compute-constant, --tp-comm-overlap through the plan): the command prints the bench's
    prediction (rel 1e-12: one code path, only the JSON round trip between)."""
    row = ROWS[row_id]
    plan = build_plan(row)
    bench = predict(row, plan)
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, cluster=cluster_of(row)).save(path)
    code = main(["evaluate", str(path), "--json", "-", *evaluate_flags(row)])
    assert code == (0 if bench["fits"] else 3)
    ev = json.loads(capsys.readouterr().out)["evaluation"]
    assert ev["iteration_s"] == pytest.approx(bench["predicted_s"], rel=1e-12, abs=0)


@pytest.mark.parametrize("item, needle", [
    ("attention_eff=0.3", "--compute-constant.attention_eff is not a known field"),
    ("attention_efficiency", "is not NAME=NUMBER"),
    ("attention_efficiency=-1", "attention_efficiency"),
])
def test_bad_compute_constant_is_one_line(item, needle, tmp_path, capsys):
    row = ROWS["torchtitan-h100-8b-8"]
    path = tmp_path / "plan.json"
    dataclasses.replace(build_plan(row), cluster=cluster_of(row)).save(path)
    assert main(["evaluate", str(path), "--compute-constant", item]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err
