"""Pass placement of vocabulary-parallel 1F1B (pure Python: schedule_ops/plan/sim).

The runtime executes these orders verbatim on every rank, so the properties checked here are
what makes it safe: every pass exactly once and in micro-batch order per kind, Megatron's P2P
call sequence untouched, deadlock freedom (the simulation models every blocking wait), and the
paper's activation memory (p+1 / p+2 micro-batches on the first stage)."""

from __future__ import annotations

import random

import pytest

from megatron_ext.planner.vocab.pass_costs import vocab_pass_costs
from megatron_ext.planner.vocab.schedule_ops import Op, skeleton_1f1b
from megatron_ext.planner.vocab.schedule_plan import plan_vocab_schedule
from megatron_ext.planner.vocab.schedule_sim import PassCosts, simulate, simulate_baseline


def _costs(p: int, seed: int) -> PassCosts:
    rng = random.Random(seed)
    if seed == 0:
        forward, vocab = [1.0] * p, 0.5
    else:  # uneven stages, e.g. a heterogeneous plan
        forward, vocab = [rng.uniform(0.3, 2.0) for _ in range(p)], rng.uniform(0.05, 2.0)
    return PassCosts(
        forward_s=tuple(forward), backward_s=tuple(f * rng.uniform(1.5, 2.5) for f in forward),
        output_forward_s=vocab, output_backward_s=0.6 * vocab, loss_s=0.05,
        input_forward_s=0.05, input_backward_s=0.05, p2p_s=0.01, broadcast_s=0.05,
        all_gather_s=0.02, all_reduce_s=0.05)


@pytest.mark.parametrize("barriers", [1, 2])
@pytest.mark.parametrize("forward_only", [False, True])
def test_plans_are_complete_ordered_and_deadlock_free(barriers: int, forward_only: bool) -> None:
    for p in (1, 2, 3, 4, 6):
        for m in (1, 2, 3, 5, 9, 16):
            for seed in (0, 1):
                timeline = plan_vocab_schedule(p, m, num_barriers=barriers,
                                               costs=_costs(p, seed), forward_only=forward_only)
                for r in range(p):
                    order = timeline.order(r)
                    skeleton = skeleton_1f1b(r, p, m, extra_warmup=0 if forward_only else
                                             barriers, forward_only=forward_only)
                    assert [op for op in order if op.kind not in _VOCAB] == skeleton
                    for kind in _kinds(r, p, forward_only):
                        mbs = [op.mb for op in order if op.kind == kind]
                        assert mbs == list(range(m)), (p, m, r, kind, mbs)
                if not forward_only:  # the paper's p+1 / p+2 micro-batches on stage 0
                    assert timeline.peak_in_flight(0) == min(p + barriers, m)


_VOCAB = {"IF", "IB", "S", "L", "T"}


def _kinds(r: int, p: int, forward_only: bool) -> list[str]:
    kinds = ["IF", "S"] + ([] if forward_only else ["T", "IB"])
    return kinds + (["L"] if r == p - 1 else [])


@pytest.mark.parametrize("barriers", [1, 2])
def test_plans_are_near_the_balanced_pipeline_bound(barriers: int) -> None:
    """Balanced stages: (m + p - 1) steps of (f + b + vocabulary work) is the 1F1B bound; the
    plans stay within 5% of it (the barriers hide behind transformer passes, as in the paper)
    and keep at most 3 micro-batches of output-layer state ([n, V/p] softmax) per stage."""
    for p, m in ((4, 32), (8, 64)):
        costs = PassCosts(forward_s=(1.0,) * p, backward_s=(2.0,) * p, output_forward_s=0.5,
                          output_backward_s=0.3, loss_s=0.05, input_forward_s=0.05,
                          input_backward_s=0.05, p2p_s=0.01, broadcast_s=0.05,
                          all_gather_s=0.02, all_reduce_s=0.05)
        step = 1.0 + 2.0 + 0.5 + 0.3 + 0.05 + 0.05
        timeline = plan_vocab_schedule(p, m, num_barriers=barriers, costs=costs)
        assert timeline.makespan_s <= 1.05 * (m + p - 1) * step
        assert max(timeline.peak_output_states(r) for r in range(p)) <= 3


def test_baseline_simulation_matches_the_1f1b_formula() -> None:
    costs = PassCosts(forward_s=(1.0,) * 4, backward_s=(2.0,) * 4)
    assert simulate_baseline(4, 10, costs).makespan_s == pytest.approx((10 + 4 - 1) * 3.0)


def test_simulation_rejects_a_cyclic_order() -> None:
    """Stage 0 runs S 0 before sending activation 0: X 0 can never be computed."""
    p, m = 2, 2
    orders = [skeleton_1f1b(r, p, m, extra_warmup=1) for r in range(p)]
    orders[0].insert(0, Op(kind="S", mb=0))
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(orders, _costs(p, 0), num_barriers=1)


def test_vocabulary_work_is_balanced_across_stages() -> None:
    """With vocabulary parallelism every stage carries 1/p of the output layer."""
    costs = vocab_pass_costs(layers_per_stage=(2, 2, 2, 2), hidden=256, ffn_hidden=1024,
                             seq_length=128, tokens=128, padded_vocab=128_000, num_shards=4,
                             num_barriers=1)
    timeline = plan_vocab_schedule(4, 16, num_barriers=1, costs=costs)
    busy = [timeline.busy_s(r) for r in range(4)]
    assert max(busy) / min(busy) < 1.01


def test_vocab_rank_lists_order_shards_by_stage_then_tp_rank() -> None:
    from megatron_ext.runtime.vocab.comm import vocab_rank_lists

    # pp=2 stages of 4 ranks, vocabulary tp=2: two replicas, shard = stage * 2 + tp rank
    assert vocab_rank_lists([[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="must divide"):
        vocab_rank_lists([[0, 1, 2], [3, 4, 5]], 2)
