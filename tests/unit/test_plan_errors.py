"""The plan file's documented error messages (issue 2, item 3), each as one exact line."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan

PLANS_DIR = Path(__file__).resolve().parents[2] / "examples" / "plans"


def _llama(num_query_groups: int = 32) -> dict[str, Any]:
    return {
        "name": "llama2-7b", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 11008,
        "num_attention_heads": 32, "num_query_groups": num_query_groups, "vocab_size": 32000,
    }


def _plan(world_size: int, stages: list[tuple[int, int]], layers: list[dict[str, Any]],
          *, micro_batch_size: int = 12, model: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "schema_version": 1, "world_size": world_size, "pp": len(stages),
        "stages": [{"start": s, "end": e} for s, e in stages], "layers": layers,
        "micro_batch_size": micro_batch_size, "global_batch_size": 96, "seq_length": 4096,
        "model": model or _llama(),
    }


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(PlanError) as info:
        ParallelPlan.from_dict(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_tp_must_divide_heads() -> None:
    layers = [{"start": 0, "end": 7, "tp": 2, "dp": 6}, {"start": 7, "end": 8, "tp": 3, "dp": 4},
              {"start": 8, "end": 32, "tp": 4, "dp": 3}]
    assert _error(_plan(12, [(0, 32)], layers)) == (
        "layers[7].tp=3 does not divide num_attention_heads=32"
    )


def test_empty_stage() -> None:
    layers = [{"start": 0, "end": 32, "tp": 2, "dp": 2}]
    message = _error(_plan(12, [(0, 16), (16, 32), (32, 32)], layers))
    assert message.startswith("stage 2 is empty"), message


def test_layer_width_must_fill_the_stage() -> None:
    layers = [{"start": 0, "end": 4, "tp": 4, "dp": 4}, {"start": 4, "end": 32, "tp": 4, "dp": 3}]
    message = _error(_plan(32, [(0, 16), (16, 32)], layers))
    assert message.startswith("tp*cp*ulysses*dp of layer 4 is 12 but world_size/pp is 16"), message


def test_ulysses_bounded_by_query_groups() -> None:
    layers = [{"start": 0, "end": 32, "ulysses": 8, "dp": 1}]
    message = _error(_plan(8, [(0, 32)], layers, micro_batch_size=1, model=_llama(4)))
    assert message.startswith("layers[0:32].ulysses=8 exceeds num_query_groups=4"), message


def _example() -> dict[str, Any]:
    return json.loads((PLANS_DIR / "llama2-7b_uniform_tp2_pp2.json").read_text())


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.pop("model"), "model is missing; add it as a JSON object"),
        (lambda d: d.pop("stages"), "stages is missing; add it as a JSON list"),
        (lambda d: d.pop("world_size"), "world_size is missing; add it"),
        (lambda d: d["stages"][0].update(middle=3), "stages[0].middle is not a known field"),
        (lambda d: d.update(pp=True), "pp=True must be an integer"),
        (lambda d: d.update(pp=2.0), "pp=2.0 must be an integer"),
        (lambda d: d.update(pp=2**70), "pp=1180591620717411303424 is out of range"),
        (lambda d: d["layers"][0].update(tp="2"), "layers[0:16].tp='2' must be an integer"),
        (lambda d: d["model"].update(num_layers=10**9),
         "model.num_layers=1000000000 exceeds the supported 100000"),
        (lambda d: d["cluster"].update(memory_gib=10**400),
         "cluster.memory_gib=1000000000000000000000000000000000000... must be a finite number"),
        (lambda d: d.update(schema_version=2), "schema_version=2 is not supported"),
        (lambda d: d.update(extra=1), "extra is not a known field; allowed: cluster,"),
        (lambda d: d.update(globl_batch_size=8),
         "globl_batch_size is not a known field; did you mean global_batch_size? allowed:"),
        (lambda d: d["layers"][0].update(zeroo=1),
         "layers[0].zeroo is not a known field; did you mean zero? allowed:"),
        (lambda d: d["layers"][0].update(tp=3),
         "tp*cp*ulysses*dp of layer 0 is 6 but world_size/pp is 4 (world_size=8, pp=2); "
         "layers[0:16].tp=3 does not divide 4 (world_size/pp): use one of 1, 2, 4 and set dp "
         "so that tp*cp*ulysses*dp = 4"),
        (lambda d: d["layers"][0].update(dp=1),
         "tp*cp*ulysses*dp of layer 0 is 2 but world_size/pp is 4 (world_size=8, pp=2); set "
         "layers[0:16].dp=2"),
        (lambda d: d.update(pp=10**5000), "pp=<16610-bit integer> is out of range"),
        (lambda d: d.update(prediction={"iteration_time_s": 1.0, "tokens_per_s": 5.0,
                                        "stage_time_s": [1.0, 1.0, 1.0]}),
         "prediction.stage_time_s has 3 entries but pp=2"),
        (lambda d: d.update(prediction={"iteration_time_s": 1.0, "tokens_per_s": 5.0,
                                        "mfu": -0.5}),
         "prediction.mfu=-0.5 must be >= 0"),
    ],
)
def test_field_errors_name_field_value_and_fix(edit: Any, expected: str) -> None:
    data = copy.deepcopy(_example())
    edit(data)
    message = _error(data)
    assert message.startswith(expected), message


def _interleaved(**change: Any) -> dict[str, Any]:
    """pp=2 x 2 chunks of llama2-7b on 8 ranks, uneven chunks (10, 6, 6, 10)."""
    data = _plan(8, [(0, 10), (10, 16), (16, 22), (22, 32)],
                 [{"start": 0, "end": 32, "tp": 2, "dp": 2}], micro_batch_size=4)
    data.update({"pp": 2, "virtual_stages": 2, **change})
    return data


def test_interleaved_plan_round_trips_and_maps_chunks_to_ranks() -> None:
    plan = ParallelPlan.from_dict(_interleaved())
    assert plan.virtual_stages == 2 and plan.rank_chunks(0) == ((0, 10), (16, 22))
    assert [plan.stage_of_layer(i) for i in (0, 9, 10, 16, 31)] == [0, 0, 1, 0, 1]
    assert plan.stage_layers(1) == tuple(range(10, 16)) + tuple(range(22, 32))
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan
    plain = ParallelPlan.from_dict(_plan(8, [(0, 16), (16, 32)],
                                         [{"start": 0, "end": 32, "tp": 2, "dp": 2}],
                                         micro_batch_size=4) | {"pp": 2})
    assert "virtual_stages" not in plain.to_dict()  # plans without interleaving keep their JSON


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"virtual_stages": 3}, "stages has 4 ranges but pp*virtual_stages=2*3=6; give one per "
         "model chunk (chunk c of rank r is stages[c*pp + r])"),
        ({"virtual_stages": 0}, "virtual_stages=0 must be >= 1"),
        ({"pp": 1, "virtual_stages": 4}, "virtual_stages=4 needs pp > 1"),
        ({"global_batch_size": 12}, "virtual_stages=2 needs the micro-batch count "
         "(global_batch_size/micro_batch_size=3) to be a multiple of pp=2"),
        ({"vocab": {"mode": "vocab_parallel", "tp": 2}}, "virtual_stages=2 with "
         "vocab.mode='vocab_parallel' is not supported"),
    ],
)
def test_interleaved_plan_errors(change: dict[str, Any], expected: str) -> None:
    message = _error(_interleaved(**change))
    assert message.startswith(expected), message


def test_vocab_tp_must_divide_query_groups() -> None:
    # megatron-core builds the embedding and output layer from a TransformerConfig at vocab.tp;
    # a searched plan once gave a 1-head model vocab.tp=2 and every rank failed in that config
    data = _plan(8, [(0, 32)], [{"start": 0, "end": 32, "tp": 2, "dp": 4}],
                 model=_llama(num_query_groups=2))
    data["vocab"] = {"mode": "tp", "tp": 4}
    assert _error(data) == (
        "vocab.tp=4 does not divide num_query_groups=2; megatron-core builds the vocabulary "
        "layers with that tp: use a vocab.tp that divides it"
    )


def test_tp_comm_overlap_needs_sequence_parallel_layers() -> None:
    """Megatron-LM's --tp-comm-overlap needs --sequence-parallel (validate_args), which tp = 1
    turns off: a plan with it needs a layer with tp > 1 and sp, and sp wherever tp > 1."""
    data = _example()  # tp 2 with sp: valid with the overlap
    data["tp_comm_overlap"] = True
    assert ParallelPlan.from_dict(data).tp_comm_overlap
    data["layers"] = [dict(r, tp=1, sp=False, dp=4) for r in data["layers"]]
    data["vocab"]["tp"] = 1
    data["micro_batch_size"] = 4
    assert _error(data) == (
        "tp_comm_overlap=true needs a layer with tp > 1 and sp=true (Megatron-LM's "
        "--tp-comm-overlap needs --sequence-parallel, which tp=1 turns off); drop "
        "tp_comm_overlap or use tp > 1 with sp")
    layers = [{"start": 0, "end": 16, "tp": 2, "sp": True, "dp": 6},
              {"start": 16, "end": 32, "tp": 4, "dp": 3}]
    mixed = _plan(12, [(0, 32)], layers)
    mixed["tp_comm_overlap"] = True
    assert _error(mixed) == (
        "tp_comm_overlap=true needs sp=true in every layer with tp > 1, layers[16:32] has tp=4 "
        "sp=false (Megatron-LM's --tp-comm-overlap needs --sequence-parallel); set sp or drop "
        "tp_comm_overlap")
    mixed["layers"][1]["sp"] = True
    assert ParallelPlan.from_dict(mixed).tp_comm_overlap
    mixed["tp_comm_overlap"] = "yes"
    assert _error(mixed).startswith("tp_comm_overlap")
