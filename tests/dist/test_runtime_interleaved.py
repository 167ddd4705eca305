"""Interleaved (virtual-stage) pipelines on megatron-core's interleaved 1F1B schedule against a
single-process megatron-core GPTModel (tests/dist/runtime_parity.py).

One 4-rank spawn (pp=2, 2 ranks per stage, 2 model chunks per rank) checks:
- uniform interleaved: 8 layers (tiny-llama shape), hidden 64, every layer dp2, chunks of 2
  (Megatron's --num-layers-per-virtual-pipeline-stage 2);
- heterogeneous interleaved with tied embeddings (tiny-gpt shape): uneven chunks (3, 1, 2, 2)
  with different strategies in and across chunks (tp2+sp, dp2 with ZeRO-1, recompute), so chunk
  boundaries re-lay their input, and the embedding on chunk 0 of stage 0 and its copy on the
  last chunk of stage 1 are kept equal by the embedding-group all-reduce;
- an interleaved plan `megatron-ext search` scores (found once in the test process; its
  `megatron-ext args` flags read back by plan-from-args, so the emitted flags run too);
- checkpoint metadata of an interleaved model: global keys and offsets, one main replica.
Each plan trains 5 steps (losses) and its step-1 gradients are compared shard by shard.

Tolerances (fp32), as in test_runtime_parity.py and for the same reason: the pipeline sums the
same terms in another order (DP reductions, ZeRO-1 reduce-scatter, micro-batch sums), which moves
fp32 results by ~1e-7 relative and Adam amplifies that a little over 5 steps; a chunk run out of
order, a missing reduction or a wrong boundary re-layout shows as >= 1e-3.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest

from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import VocabStrategy as V
from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

TOLERANCES = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}


def _eight_layers(name: str):
    from megatron_ext.presets import MODEL_PRESETS

    return dataclasses.replace(MODEL_PRESETS[name], num_layers=8)


def plans() -> dict:
    from tests.dist.runtime_parity import make_plan

    llama, gpt = _eight_layers("tiny-llama"), _eight_layers("tiny-gpt")
    even = [(2 * j, 2 * j + 2) for j in range(4)]
    uneven = [(0, 3), (3, 4), (4, 6), (6, 8)]
    mixed = [L(tp=2, sp=True), L(dp=2, zero=1), L(dp=2, recompute="full"), L(tp=2),
             L(dp=2), L(tp=2, sp=True, recompute="selective"), L(dp=2, zero=1), L(tp=2)]
    return {
        "uniform pp2 x vpp2": make_plan(llama, [L(dp=2)] * 8, pp=2, stages=even, num_mb=4,
                                        virtual_stages=2),
        "heterogeneous uneven chunks, tied embeddings": make_plan(
            gpt, mixed, pp=2, stages=uneven, num_mb=4, virtual_stages=2, vocab=V(tp=2)),
    }


def searched_plan():
    """An interleaved plan from the search, through `megatron-ext args` and plan-from-args."""
    from megatron_ext.flags.emit import plan_to_megatron_args
    from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
    from megatron_ext.planner.cost.model import CostModel
    from megatron_ext.planner.search import SearchOptions, search
    from megatron_ext.planner.training import TrainingSpec
    from megatron_ext.presets import cluster_preset

    cluster = cluster_preset("dgx-a100-80g", num_nodes=1, memory_gib=80)
    cluster = dataclasses.replace(cluster, gpus_per_node=4)
    cm = CostModel(_eight_layers("tiny-llama"), cluster,
                   TrainingSpec(global_batch_size=16, seq_length=32, precision="fp32",
                                allow_vocab_parallel=False))
    found = search(cm, options=SearchOptions(explain_infeasible=False))
    plan = next(p for p in (found.plan, *found.candidates) if p.virtual_stages > 1)
    argv = plan_to_megatron_args(plan, plan_path="unused.json").argv
    if "--strategy-config" in argv:  # per-layer strategies: the plan file itself runs
        return plan
    return plan_from_megatron_args(parse_megatron_args(list(argv), world_size=4), 4)


def _run(rank: int, world_size: int, *, searched) -> dict:
    warnings.filterwarnings("ignore")
    from tests.dist.runtime_parity import (
        check_sharded_state_dict,
        make_batches,
        reference_run,
        run_plan,
    )

    todo = plans()
    todo["searched (args -> plan-from-args)"] = searched
    refs: dict = {}
    out = {}
    for name, plan in todo.items():
        start = time.perf_counter()
        assert plan.virtual_stages > 1, name
        key = (plan.model, plan.micro_batch_size, plan.num_microbatches, plan.seq_length)
        if key not in refs:
            refs[key] = reference_run(plan, make_batches(plan, 5), seed=11)
        out[name] = {**run_plan(plan, ref=refs[key], seed=11, **TOLERANCES),
                     "seconds": time.perf_counter() - start}
    out["sharded state dict"] = {"shards": check_sharded_state_dict(
        todo["heterogeneous uneven chunks, tied embeddings"])}
    return out


def test_interleaved_parity_4_ranks() -> None:
    results = run_distributed(_run, world_size=4, timeout_s=900, searched=searched_plan())
    for name, result in results[0].items():
        if name == "sharded state dict":
            assert result["shards"] > 0
            continue
        assert result["grads_compared"] > 0, name
        assert result["losses"][-1] < result["losses"][0] - 0.3, (name, result["losses"])
