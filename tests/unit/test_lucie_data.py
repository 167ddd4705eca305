"""OpenLLM-France's Lucie-7B parallelism table (tools/data/lucie/): the copy is the upstream file
byte for byte, tools/bench_published.py reads every kept line with its own values (checked by
hand against the file), a damaged file stops it with one line naming the field, and the row
fields that carry flash attention and dropout leave the other sources' runs as they were."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from megatron_ext.calibration import lucie
from megatron_ext.calibration.inputs import benchmark_rows
from megatron_ext.calibration.lucie import (
    LUCIE_BLOB,
    LUCIE_DIR,
    LUCIE_FILE,
    LUCIE_RULES,
    LUCIE_SOURCE,
    check_lucie_files,
    lucie_flops_factor,
    lucie_rows,
    read_lucie_csv,
)
from megatron_ext.calibration.residuals import calibrates, residual_file
from megatron_ext.calibration.rows import (
    build_plan,
    cluster_label,
    cluster_of,
    compute_of,
    dropout_of,
    flash_attention_of,
    is_deepspeed_pipeline,
    is_mosaic,
    layout_label,
    measured_iteration_s,
    megatron_flags,
    run_settings,
)
from megatron_ext.calibration.scoring import predict, run
from megatron_ext.calibration.sources import DEFAULT_DATA, git_blob_id
from megatron_ext.errors import PlanError
from megatron_ext.planner.cost.compute import ComputeProfile

LINE_2 = (b"0,1_seq4k,lucie7b-seq4k-32nodes-tp2-pp4-z0-gbz1024-mbz4-2063180.iterations,2063180,"
          b"32k,32,256,2,4,32,0,1024,4,8,3,96.94,132.613,543182.848,21.3078783998608")



def test_copy_is_the_upstream_blob():
    assert check_lucie_files() == []
    assert git_blob_id((LUCIE_DIR / LUCIE_FILE).read_bytes()) == LUCIE_BLOB


def test_rows_count_and_hand_checked_values():
    rows = lucie_rows()
    # 44 lines: the 3_recompute_activation line left out, lines 42-44 one layout measured 3 times
    assert len(rows) == 41 and len({r["id"] for r in rows}) == 41
    assert sum(r["model_name"] == "Lucie-7B (32k vocab)" for r in rows) == 36
    assert sum(r["model_name"] == "Lucie-7B (65k vocab)" for r in rows) == 5
    by_line = {int(r["source_ref"].split(", line ")[1].split()[0].rstrip(",")): r for r in rows}
    assert 9 not in by_line  # 3_recompute_activation

    # line 2: 32 nodes, tp2 pp4 dp32, gbz 1024, mbz 4, 132.613 samples/s = 543182.848 tokens/s
    r = by_line[2]
    assert (r["num_gpus"], r["tp"], r["pp"], r["dp"]) == (256, 2, 4, 32)
    assert (r["global_batch_size"], r["micro_batch_size"], r["vocab_size"]) == (1024, 4, 32000)
    assert r["iter_time_s"] == pytest.approx(1024 / 132.613, rel=1e-12)
    assert r["iter_time_s"] == pytest.approx(1024 * 4096 / 543182.848, rel=1e-9)
    assert measured_iteration_s(r) == (r["iter_time_s"], "iteration time")
    # line 4: 2_vocab_65k, tp2 pp4 dp32 mbz2, 122.981 samples/s
    r = by_line[4]
    assert (r["model_name"], r["vocab_size"], r["micro_batch_size"]) == (
        "Lucie-7B (65k vocab)", 65024, 2)
    assert r["iter_time_s"] == pytest.approx(1024 / 122.981, rel=1e-12)
    # line 18: pp 0 is --no-pipeline-parallel: one stage, DeepSpeed's engine without the pipe
    r = by_line[18]
    assert (r["tp"], r["pp"], r["dp"], r["deepspeed_pipeline_engine"]) == (4, 1, 32, False)
    assert layout_label(r) == "tp4 pp1 dp32 nopipe mb2"
    assert by_line[37]["deepspeed_pipeline_engine"] is True  # pp 1: the pipe engine, one stage
    # lines 42, 43, 44: 1 node tp1 pp2 dp4 gbz 256 mbz 1 three times: one run at the mean
    r = by_line[42]
    assert r["repeats"] == 3 and "line 42, 43, 44" in r["source_ref"]
    assert r["iter_time_s"] == pytest.approx((256 / 6.453 + 256 / 6.447 + 256 / 6.438) / 3,
                                             rel=1e-12)

    # the fixed rules, the same on every row
    for key, value in LUCIE_RULES.items():
        assert {str(x[key]) for x in rows} == {str(value)}
    assert {r["source"] for r in rows} == {LUCIE_SOURCE}


def test_rules_reach_the_plan_and_the_pricing():
    """Llama-style model, bf16, DeepSpeed's BF16_Optimizer (ZeRO stage 0 in the config: the
    optimizer state split as ZeRO-1, reduction after the last backward), Jean Zay's network
    under its own label, flash attention on and dropout off, synchronous launches of the
    fork's kernels."""
    rows = lucie_rows()
    r = next(x for x in rows if x["id"].startswith("lucie7b-v32k-28-"))  # 4 nodes tp1 pp2
    plan = build_plan(r)
    m = plan.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads,
            m.num_query_groups) == (32, 4096, 11008, 32, 32)
    assert (m.activation, m.normalization, m.position_embedding, m.tied_embeddings,
            m.add_bias_linear) == ("swiglu", "RMSNorm", "rope", False, False)
    assert plan.precision == "bf16" and plan.seq_length == 4096
    assert {layer.zero for layer in plan.layers} == {1}
    assert {layer.recompute for layer in plan.layers} == {"none"}
    compute = compute_of(r, ComputeProfile())
    assert (compute.host_overlap_power, compute.layer_forward_kernels,
            compute.layer_backward_kernels, compute.layer_extra_elementwise_passes) == (
        1.0, 40, 94, 33)
    # synchronous launches of the fork's kernels cost time, not memory
    plain = predict({k: v for k, v in r.items() if k != "kernel_profile"}, plan)
    stated = predict(r, plan)
    assert stated["predicted_s"] > 1.1 * plain["predicted_s"]
    assert stated["peak_gib"] == plain["peak_gib"]
    # the optimizer state split over 16 ranks: TP1 PP2 micro-batch 2 fits in 80 GB, as it ran
    assert stated["fits"] and stated["peak_gib"] < 60
    assert is_deepspeed_pipeline(r) and all(is_deepspeed_pipeline(x) for x in rows)
    # DeepSpeed's BF16_Optimizer, with or without the pipeline module
    assert {run_settings(x)["engine"] for x in rows} == {"deepspeed-bf16"}
    assert flash_attention_of(r) and not dropout_of(r)
    assert cluster_of(r).inter_node.bandwidth_bytes_per_s == 5.5e9
    assert cluster_label(r) == "jean-zay-a100-80g-2024"
    # the TFLOPs column is Megatron-DeepSpeed's formula with 3 passes (no recompute); the line
    # left out (3_recompute_activation, vocabulary column 65k) gives 4 passes at 32000 tokens
    runs = read_lucie_csv(LUCIE_DIR / LUCIE_FILE)
    assert lucie_flops_factor(runs[0], 32000) == pytest.approx(3, abs=1e-3)
    recompute = next(x for x in runs if x["expe"] == "3_recompute_activation")
    assert lucie_flops_factor(recompute, 32000) == pytest.approx(4, abs=1e-3)


def test_flash_attention_and_dropout_fields_keep_the_other_rows():
    """Rows without the fields keep the old rule (flash attention and no dropout for MosaicML
    only), the same flags, and the same prediction as with the old rule written out."""
    rows = json.loads(Path(DEFAULT_DATA).read_text())["rows"]
    new = {"flash_attention", "dropout", "normalization", "position_embedding",
           "tied_embeddings", "bias_linear", "deepspeed_pipeline_engine"}
    assert not any(new & set(r) for r in rows)
    for r in rows:
        assert flash_attention_of(r) == is_mosaic(r)
        assert dropout_of(r) == (not is_mosaic(r))
        flags = megatron_flags(r)
        assert ("--disable-bias-linear" in flags) == is_mosaic(r)
        assert ("--hidden-dropout" in flags) == is_mosaic(r)
        assert not {"--swiglu", "--normalization", "--position-embedding-type",
                    "--untie-embeddings-and-output-weights"} & set(flags)
    mosaic = next(r for r in rows if is_mosaic(r))
    sc21 = next(r for r in rows if r["source"].startswith("Narayanan et al. SC'21 Table 2"))
    for r in (mosaic, sc21):
        plan = build_plan(r)
        stated = dict(r, flash_attention=is_mosaic(r), dropout=not is_mosaic(r))
        assert predict(stated, plan) == predict(r, plan)
    # the field is read: flash attention on frees the attention scores of the SC'21 row
    plan = build_plan(sc21)
    assert (predict(dict(sc21, flash_attention=True), plan)["peak_gib"]
            < predict(sc21, plan)["peak_gib"])


def _damaged(tmp_path: Path, old: bytes, new: bytes) -> Path:
    directory = tmp_path / "lucie"
    shutil.copytree(LUCIE_DIR, directory)
    path = directory / "expe_summary.csv"
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    return directory


@pytest.mark.parametrize("old, new, words", [
    (b",2,4,32,0,1024,4,8,", b",2,4,32,0,1024,x,8,", ["line 2", "'mbz'", "'x'"]),
    (b"132.613,543182.848", b"-132.613,543182.848", ["line 2", "'samples_per_seconds'",
                                                    "'-132.613'"]),
    (b"132.613,543182.848", b"132.613,543182.000", ["line 2", "'token_per_second'"]),
    (b",96.94,", b",129.25,", ["line 2", "'TFLOPs'", "129.25", "4.000"]),
    (b"2063180,32k,", b"2063180,65k,", ["line 2", "'vocab_size'", "'65k'"]),
    (b",2,4,32,0,1024,4,8,", b",2,4,16,0,1024,4,8,", ["line 2", "'nGPUs'"]),
    (b",2,4,32,0,1024,4,8,", b",2,4,32,1,1024,4,8,", ["line 2", "'z'"]),
    (LINE_2, LINE_2.rsplit(b",", 1)[0], ["line 2", "18 fields"]),
    (b",gbz,mbz,", b",gbs,mbz,", ["line 1", "header"]),
])
def test_damaged_file_is_one_line_naming_the_field(tmp_path, old, new, words):
    directory = _damaged(tmp_path, old, new)
    with pytest.raises(PlanError) as err:
        lucie_rows(directory)
    message = str(err.value)
    assert "\n" not in message and "expe_summary.csv" in message
    for word in words:
        assert word in message
    # the benchmark refuses it in one line (tools/bench_published.py prints it and exits 2)
    # before predicting anything
    with pytest.raises(PlanError) as err:
        benchmark_rows(lucie_dir=directory, with_vtrain=False)
    assert "\n" not in str(err.value)


def test_changed_copy_is_refused(tmp_path, monkeypatch):
    """A changed byte in the shipped copy is caught by the blob check (the bench refuses)."""
    directory = _damaged(tmp_path, b"21.3078783998608", b"21.3078783998609")
    monkeypatch.setattr(lucie, "LUCIE_DIR", directory.resolve())
    assert check_lucie_files() == ["expe_summary.csv"]
    with pytest.raises(PlanError, match="differ from the upstream"):
        benchmark_rows(with_vtrain=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_runs_not_for_calibration_are_scored_but_fit_nothing():
    """A source whose settings are incomplete (Lucie's rows) is held out and scored, but sets
    neither another source's refitted efficiency nor the interval table: adding it leaves both
    as they were."""
    lucie = lucie_rows()
    assert all(r["not_for_calibration"] for r in lucie)
    base = json.loads(Path(DEFAULT_DATA).read_text())["rows"]
    base = [r for r in base if r["source"].startswith(("Narayanan", "Korthikanti"))]
    picked = lucie[:3]
    without = run(base)
    with_lucie = run(base + picked)
    assert [r["loso_gemm_efficiency"] for r in with_lucie["rows"][:len(base)]] == [
        r["loso_gemm_efficiency"] for r in without["rows"]]
    assert residual_file(with_lucie["rows"]) == residual_file(without["rows"])
    held = [r for r in with_lucie["rows"] if r["source"] == LUCIE_SOURCE]
    assert len(held) == 3 and all(r["loso_predicted_s"] > 0 for r in held)
    assert not any(calibrates(r) for r in held)
