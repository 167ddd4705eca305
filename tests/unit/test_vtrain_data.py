"""vTrain's measured layout sweeps (tools/data/vtrain/): the copies are the upstream files byte for
byte, tools/bench_published.py reads every run with the values of its CSV line (checked by hand
against the files), and a damaged file stops it with one line naming the field."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from megatron_ext.calibration import vtrain
from megatron_ext.calibration.inputs import benchmark_rows
from megatron_ext.calibration.ranking import baseline_steps, sweep_summary
from megatron_ext.calibration.rows import build_plan, cluster_name, is_deepspeed_pipeline
from megatron_ext.calibration.sources import git_blob_id
from megatron_ext.calibration.vtrain import (
    VTRAIN_DIR,
    VTRAIN_RULES,
    check_vtrain_files,
    vtrain_rows,
)
from megatron_ext.errors import PlanError


def test_copies_are_the_upstream_blobs():
    assert check_vtrain_files() == []
    # git's blob id of a known text, so the check itself is git's (`git hash-object`)
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_rows_count_and_hand_checked_values():
    rows = vtrain_rows()
    single = [r for r in rows if r["source"] == "vTrain single node"]
    multi = [r for r in rows if r["source"] == "vTrain multi node"]
    # 1,440 single-node lines; 109 multi-node lines of which one repeats a layout
    assert (len(single), len(multi)) == (1440, 108)
    assert len({r["id"] for r in rows}) == len(rows)
    by_ref = {r["source_ref"].rsplit(", line ", 1)[1] + r["source"][7:]: r for r in rows}

    # ground_truth_single.csv line 2: 2,16,8,1024,16,24,1024,1,1,2,372.160408
    r = by_ref["2single node"]
    assert (r["num_gpus"], r["global_batch_size"], r["micro_batch_size"]) == (2, 16, 8)
    assert (r["hidden_size"], r["num_heads"], r["num_layers"], r["seq_len"]) == (1024, 16, 24,
                                                                                 1024)
    assert (r["tp"], r["dp"], r["pp"]) == (1, 1, 2)
    assert r["iter_time_s"] == pytest.approx(0.372160408, rel=1e-12)
    assert r["model_name"] == "GPT 0.35B (24 x 1024)" and r["ffn_hidden_size"] == 4096
    # line 721: 2,2,1,2048,16,12,1024,1,1,2,88.449306
    r = by_ref["721single node"]
    assert (r["num_gpus"], r["global_batch_size"], r["micro_batch_size"], r["hidden_size"],
            r["num_layers"], r["tp"], r["dp"], r["pp"]) == (2, 2, 1, 2048, 12, 1, 1, 2)
    assert r["iter_time_s"] == pytest.approx(0.088449306, rel=1e-12)
    # line 1441 (the last): 4,64,8,1024,16,24,1024,1,4,1,474.725583
    r = by_ref["1441single node"]
    assert (r["num_gpus"], r["global_batch_size"], r["micro_batch_size"], r["tp"], r["dp"],
            r["pp"]) == (4, 64, 8, 1, 4, 1)
    assert r["iter_time_s"] == pytest.approx(0.474725583, rel=1e-12)

    # ground_truth_multi.csv line 2: 3.6,64,512,8,3072,32,30,2048,1,64,1,3566.5
    r = by_ref["2multi node"]
    assert (r["num_gpus"], r["global_batch_size"], r["micro_batch_size"], r["hidden_size"],
            r["num_heads"], r["num_layers"], r["seq_len"], r["tp"], r["dp"], r["pp"]) == (
        64, 512, 8, 3072, 32, 30, 2048, 1, 64, 1)
    assert r["iter_time_s"] == pytest.approx(3.5665, rel=1e-12)
    assert r["model_name"] == "GPT 3.6B (30 x 3072)"
    # lines 92 and 93 measure one layout twice (53909.6, 53937.9 ms): one run at the mean
    r = by_ref["92, 93multi node"]
    assert (r["tp"], r["dp"], r["pp"], r["micro_batch_size"], r["repeats"]) == (4, 4, 32, 2, 2)
    assert r["iter_time_s"] == pytest.approx((53.9096 + 53.9379) / 2, rel=1e-12)

    # the fixed rules, the same on every row
    for key, value in VTRAIN_RULES.items():
        assert {str(x[key]) for x in rows} == {str(value)}
    tp4 = build_plan(r)
    assert {layer.zero for layer in tp4.layers} == {0} and tp4.precision == "fp16"
    assert cluster_name(r) == "dgx-a100-80g" and is_deepspeed_pipeline(r)


def _damaged(tmp_path: Path, name: str, old: bytes, new: bytes) -> Path:
    directory = tmp_path / "vtrain"
    shutil.copytree(VTRAIN_DIR, directory)
    path = directory / name
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    return directory


@pytest.mark.parametrize("name, old, new, words", [
    ("ground_truth_single.csv", b"2,16,8,1024,16,24,1024,1,1,2,372.160408",
     b"2,16,x,1024,16,24,1024,1,1,2,372.160408", ["line 2", "'micro batch'", "'x'"]),
    ("ground_truth_single.csv", b"2,16,8,1024,16,24,1024,1,1,2,372.160408",
     b"2,16,8,1024,16,24,1024,1,1,2,-3", ["line 2", "'iteration time (ms)'", "'-3'"]),
    ("ground_truth_single.csv", b"2,16,8,1024,16,24,1024,1,1,2,372.160408",
     b"2,16,8,1024,16,24,1024,1,2,2,372.160408", ["line 2", "'# GPUs'"]),
    ("ground_truth_multi.csv", b"3.6,64,512,8,3072,32,30,2048,1,64,1,3566.5",
     b"3.6,64,512,8,3072,32,30,2048,1,64,1", ["line 2", "11 fields"]),
    ("ground_truth_multi.csv", b"micro batch", b"micro batch size", ["line 1", "header"]),
])
def test_damaged_file_is_one_line_naming_the_field(tmp_path, name, old, new, words):
    directory = _damaged(tmp_path, name, old, new)
    with pytest.raises(PlanError) as err:
        vtrain_rows(directory)
    message = str(err.value)
    assert "\n" not in message and name in message
    for word in words:
        assert word in message
    # the benchmark refuses it in one line (tools/bench_published.py prints it and exits 2)
    # before predicting anything
    with pytest.raises(PlanError) as err:
        benchmark_rows(vtrain_dir=directory, with_lucie=False)
    assert "\n" not in str(err.value)


def test_changed_copy_is_refused(tmp_path, monkeypatch):
    """A changed byte in the shipped copy is caught by the blob check (the bench refuses)."""
    directory = _damaged(tmp_path, "ground_truth_multi.csv", b"3566.5", b"3566.6")
    monkeypatch.setattr(vtrain, "VTRAIN_DIR", directory.resolve())
    assert check_vtrain_files() == ["ground_truth_multi.csv"]
    with pytest.raises(PlanError, match="differ from the upstream"):
        benchmark_rows(with_lucie=False)


def test_reference_predictor_and_sweep_summary():
    # 1F1B with m micro-batches on pp stages: m + pp - 1 steps of ceil(L / pp) layers
    assert baseline_steps(8, 1, 24) == 8 * 24
    assert baseline_steps(8, 4, 24) == 11 * 6
    assert baseline_steps(1, 3, 20) == 3 * 7
    sweep = {"layouts": 9, "spearman": 0.9, "top1_regret": 0.01, "pairs_ordered": 0.9,
             "baseline": {"spearman": 0.5, "top1_regret": 0.2, "pairs_ordered": 0.6}}
    small = dict(sweep, layouts=3, spearman=-1.0)
    missed = dict(sweep, top1_regret=0.06)
    s = sweep_summary([sweep, small, missed])
    assert (s["sweeps"], s["big_sweeps"], s["meeting_targets"]) == (3, 2, 1)
    assert s["median_spearman"] == pytest.approx(0.9)
    assert s["baseline_median_spearman"] == pytest.approx(0.5)
    assert s["baseline_meeting_targets"] == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
