"""FlexSP runtime pieces that need no second process: varlen attention, head checks, rank views."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from megatron_ext.errors import PlanError
from megatron_ext.planner.flexsp import cost_model_from_specs, plan_step, sample_lengths
from megatron_ext.planner.flexsp.step_plan import (
    MicroBatchPlan,
    SPGroup,
    StepPlan,
    token_split,
)
from megatron_ext.presets import cluster_preset, model_preset
from megatron_ext.runtime.flexsp import (
    check_ulysses_degree,
    rank_microbatches,
    varlen_attention,
)
from megatron_ext.runtime.flexsp.dispatch import all_rank_microbatches
from megatron_ext.runtime.flexsp.documents import split_documents
from megatron_ext.runtime.flexsp.ulysses import kv_repeat_factor


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Explicit softmax(q k^T / sqrt(d) + causal mask) v per sequence, kv heads repeated."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = torch.zeros_like(q)
    for a, b in itertools.pairwise(cu):
        scores = torch.einsum("snd,tnd->nst", q[a:b], k[a:b]) / math.sqrt(q.shape[-1])
        mask = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out[a:b] = torch.einsum("nst,tnd->snd", probs, v[a:b])
    return out


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_varlen_attention_matches_naive_per_sequence(kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    cu = [0, 7, 8, 20, 33]  # includes a length-1 sequence
    q = torch.randn(33, 4, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(33, kv_heads, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(33, kv_heads, 8, dtype=torch.float64, generator=gen)
    # fp64, same math in a different order: agreement to rounding
    torch.testing.assert_close(varlen_attention(q, k, v, cu), _naive(q, k, v, cu),
                               rtol=1e-12, atol=1e-12)


def test_ulysses_degree_checks() -> None:
    check_ulysses_degree(8, 2, 4)  # kv heads repeated 2x: one per rank
    assert kv_repeat_factor(2, 4) == 2 and kv_repeat_factor(8, 4) == 1
    with pytest.raises(PlanError, match="num_attention_heads=6 divisible by 4.*at 2"):
        check_ulysses_degree(6, 6, 4)
    with pytest.raises(PlanError, match="num_query_groups=3"):
        check_ulysses_degree(12, 3, 2)


def test_rank_views_cover_every_token_once() -> None:
    lengths = (13, 2, 9, 30, 4)
    plan = StepPlan(lengths=lengths, num_gpus=4, predicted_time_s=0.0, microbatches=(
        MicroBatchPlan(predicted_time_s=0.0, groups=(
            SPGroup(start_rank=0, degree=2, seq_ids=(0, 1)),
            SPGroup(start_rank=2, degree=2, seq_ids=()))),
        MicroBatchPlan(predicted_time_s=0.0, groups=(
            SPGroup(start_rank=0, degree=4, seq_ids=(3, 2, 4)),)),
    ))
    plan.check()
    views = [rank_microbatches(plan, r) for r in range(4)]
    assert views[2][0] is None and views[3][0] is None  # idle group
    for m in range(2):
        got: dict[int, set[int]] = {}
        for r in range(4):
            view = views[r][m]
            if view is None:
                continue
            assert view.num_tokens == view.token_counts[view.group_rank]
            for seq, lo, hi in view.pieces:
                assert got.setdefault(seq, set()).isdisjoint(range(lo, hi))
                got[seq] |= set(range(lo, hi))
        for group in plan.microbatches[m].groups:
            for seq in group.seq_ids:
                assert got[seq] == set(range(lengths[seq]))
    assert [b - a for a, b in token_split(45, 4)] == [11, 11, 11, 12]


def test_plan_check_rejects_groups_with_idle_ranks() -> None:
    plan = StepPlan(lengths=(3,), num_gpus=4, predicted_time_s=0.0, microbatches=(
        MicroBatchPlan(predicted_time_s=0.0, groups=(
            SPGroup(start_rank=0, degree=4, seq_ids=(0,)),)),))
    with pytest.raises(PlanError, match="3 tokens, fewer than its 4 ranks"):
        plan.check()
    with pytest.raises(PlanError, match="not an aligned power of two"):
        StepPlan(lengths=(9,), num_gpus=4, predicted_time_s=0.0, microbatches=(
            MicroBatchPlan(predicted_time_s=0.0, groups=(
                SPGroup(start_rank=0, degree=1, seq_ids=()),
                SPGroup(start_rank=1, degree=2, seq_ids=(0,)),
                SPGroup(start_rank=3, degree=1, seq_ids=()))),)).check()


def test_all_rank_views_match_per_rank_views() -> None:
    cost = cost_model_from_specs(model_preset("llama2-7b"), cluster_preset("dgx-h100",
                                                                           num_nodes=2))
    lengths = sample_lengths("wlb_llm_like", 64, max_length=65536, rng=np.random.default_rng(0))
    plan = plan_step(lengths, cost)
    assert all_rank_microbatches(plan) == [rank_microbatches(plan, r) for r in range(16)]


def test_split_documents_cuts_after_every_eod() -> None:
    eod = 0
    tokens = torch.tensor([[5, 6, 0, 7, 0, 8, 9, 9],  # two EODs: 3 + 2 + 3 tokens
                           [1, 2, 3, 4, 5, 6, 7, 0],  # EOD last: one document
                           [1, 2, 3, 4, 5, 6, 7, 8]])  # no EOD: one document
    labels = tokens.roll(-1, dims=1)
    mask = torch.ones_like(tokens, dtype=torch.float)
    mask[0, 4] = 0.0
    docs = split_documents(tokens, labels, mask, eod)
    assert [d.shape[0] for d in docs] == [3, 2, 3, 8, 8]
    expected = torch.stack([tokens, labels, mask.long()], -1).reshape(-1, 3)
    assert torch.equal(torch.cat(docs), expected)
    assert docs[1][:, 2].tolist() == [1, 0]  # loss mask travels with its token
