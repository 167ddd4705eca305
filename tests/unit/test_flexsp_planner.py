"""FlexSP planner: cost model, multiset enumeration, bounds, plan properties, MILP oracle."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

from megatron_ext.errors import PlanError
from megatron_ext.planner.flexsp import (
    FlexSPCostModel,
    PlannerOptions,
    cost_model_from_specs,
    paper_gpt7b_a100,
    plan_step,
    sample_lengths,
)
from megatron_ext.planner.flexsp.assign import assign
from megatron_ext.planner.flexsp.cost import FLEXSP_A100_A2A_GBPS, a2a_bandwidths
from megatron_ext.planner.flexsp.level_pack import level_pack_search
from megatron_ext.planner.flexsp.microbatch import make_problem, microbatch_candidates
from megatron_ext.planner.flexsp.milp import solve_microbatch_milp
from megatron_ext.planner.flexsp.multisets import enumerate_multisets, lower_bounds
from megatron_ext.planner.profile.profiles import ClusterProfile, CollectiveCurve
from megatron_ext.presets import cluster_preset, model_preset
from megatron_ext.specs import ClusterSpec, LinkSpec


def _h100(num_nodes: int = 8, model: str = "llama2-7b", **kw: object) -> FlexSPCostModel:
    return cost_model_from_specs(model_preset(model), cluster_preset("dgx-h100",
                                                                     num_nodes=num_nodes), **kw)


def test_paper_constants_reproduce_the_worked_example() -> None:
    # FlexSP's fitted GPT-7B/A100 constants and profiled per-degree all-to-all bandwidths;
    # reference §3 worked example (total ms per sequence at SP 8/16/32/64). The table is
    # printed to 2-3 significant digits (1.8 s holds 1.75-1.85 s), hence 3%.
    cost = paper_gpt7b_a100(64)
    table = {4096: (116, 102, 69, 39), 16384: (591, 473, 310, 174),
             65536: (4400, 2900, 1800, 950), 262144: (50800, 28200, 15300, 7900)}
    for length, row in table.items():
        for degree, expect_ms in zip((8, 16, 32, 64), row):
            got = cost.seq_time_s(length, length * length, degree) * 1e3
            assert got == pytest.approx(expect_ms, rel=0.03), (length, degree, got)
    assert cost.capacity_tokens == pytest.approx(5992, rel=0.02)  # reference: ~5,992 tokens


def test_topology_all_to_all_reproduces_flexsp_measurements() -> None:
    # FlexSP's cluster as a ClusterSpec: 8 x 8 A100, 400 Gb/s IB per node = 6.25 GB/s per GPU.
    # The default all_to_all_inter_efficiency was derived from that table, so the node-spanning
    # degrees must come back to the table's 2-3 digits (1%); the intra-node ones are NVLink
    # formula values (FlexSP measured less there: see docs/benchmarks.md).
    a100 = ClusterSpec(num_nodes=8, memory_gib=40.0, peak_flops=312e12,
                       intra_node=LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=0.0),
                       inter_node=LinkSpec(bandwidth_bytes_per_s=6.25e9, latency_s=0.0))
    got = dict(a2a_bandwidths(a100, 64))
    for degree in (16, 32, 64):
        assert got[degree] / 1e9 == pytest.approx(FLEXSP_A100_A2A_GBPS[degree], rel=0.01)
    assert got[8] == pytest.approx(300e9 * 8 / 7)  # 7/8 of the buffer over NVLink
    # one efficiency overrides the table; a measured profile curve overrides the topology
    assert dict(a2a_bandwidths(a100, 64, inter_efficiency=0.5))[64] == pytest.approx(
        6.25e9 * 0.5 * 64 / 56)
    curve = CollectiveCurve(collective="all_to_all", group_size=16, stride=1, ranks_per_node=8,
                            num_bytes=(1e6, 1e7, 1e8), seconds=(1e-3, 1e-2, 1e-1))
    profile = ClusterProfile(cluster=a100, backend="nccl", device="test", collectives=(curve,))
    measured = dict(a2a_bandwidths(a100, 64, profile=profile))
    assert measured[16] == pytest.approx(1e9, rel=1e-6) and measured[32] == got[32]
    cost = cost_model_from_specs(model_preset("llama2-7b"), a100, profile=profile)
    per_device = cost.a2a_bytes_per_token(16) / 16
    assert cost.a2a_s_per_token(16) == pytest.approx(per_device / 1e9, rel=1e-6)


def test_derived_cost_model_shapes() -> None:
    cost = _h100()
    assert cost.degrees == (1, 2, 4, 8, 16, 32)  # llama2-7b: 32 heads cap the degree
    assert cost.a2a_s_per_token(1) == 0.0 and cost.a2a_latency_s(1) == 0.0
    # leaving the 8-GPU node (NVLink 360 GB/s -> 45 GB/s x 0.83 all-to-all efficiency per GPU):
    # all-to-all GPU-seconds per token jump 5.5x from degree 8 to 16 (8/16 of the traffic goes
    # over the ~10x slower link), and larger spans are less efficient still
    assert 16 * cost.a2a_s_per_token(16) > 5 * 8 * cost.a2a_s_per_token(8)
    assert 32 * cost.a2a_s_per_token(32) > 16 * cost.a2a_s_per_token(16) * 1.5
    # GQA (8 kv heads): kv travels unduplicated up to degree 8, then one kv head per rank
    gqa = _h100(model="llama3-8b")
    assert gqa.a2a_bytes_per_token(8) == gqa.a2a_bytes_per_token(2)
    assert gqa.a2a_bytes_per_token(16) > gqa.a2a_bytes_per_token(8)
    assert 10_000 < cost.capacity_tokens < 30_000
    assert cost.min_degree_for(393_216) == 32
    with pytest.raises(PlanError, match="sequence length 999999"):
        cost.min_degree_for(999_999)


@pytest.mark.parametrize(("degrees", "count"), [((1, 2, 4, 8, 16, 32, 64), 1828),
                                                ((2, 4, 8, 16, 32, 64), 202)])
def test_multiset_counts_match_the_reference(degrees: tuple[int, ...], count: int) -> None:
    rows = enumerate_multisets(64, degrees)
    assert rows.shape == (count, len(degrees))
    assert (rows @ np.asarray(degrees) == 64).all()
    assert len({tuple(r) for r in rows}) == count


def test_lower_bound_never_exceeds_an_assignment() -> None:
    cost = _h100(num_nodes=2)
    rng = np.random.default_rng(0)
    for _ in range(5):
        lengths = np.sort(sample_lengths("wlb_llm_like", 40, max_length=65536, rng=rng))[::-1]
        problem = make_problem(lengths, cost)
        counts = enumerate_multisets(16, cost.degrees)
        bound = lower_bounds(counts, problem.degrees, problem.times, problem.min_deg_idx,
                             problem.lengths, problem.capacity_tokens)
        for idx in rng.choice(len(counts), size=30, replace=False):
            result = assign(problem, counts[idx], num_big=lengths.size)
            if result is not None:
                assert bound[idx] <= result.makespan_s * (1 + 1e-9)


@pytest.mark.parametrize("distribution", ["wikipedia", "wlb_llm_like", "github_like"])
def test_plan_properties(distribution: str) -> None:
    cost = _h100()
    rng = np.random.default_rng(1)
    lengths = sample_lengths(distribution, 256, max_length=131072, rng=rng)
    plan = plan_step(lengths, cost)
    # each sequence once, aligned groups covering all 64 devices, memory respected
    plan.check(capacity_tokens=cost.capacity_tokens)
    assert plan.num_gpus == 64 and plan.num_tokens == int(lengths.sum())
    for mb in plan.microbatches:
        for g in mb.groups:
            assert g.degree <= 8 or g.degree % 8 == 0  # inside a node or whole nodes
            assert g.predicted_time_s == pytest.approx(
                cost.group_time_s([int(lengths[i]) for i in g.seq_ids], g.degree))
        assert mb.predicted_time_s == pytest.approx(
            cost.fixed_s_per_microbatch + max(g.predicted_time_s for g in mb.groups))
    assert plan.predicted_time_s == pytest.approx(sum(m.predicted_time_s for m in
                                                      plan.microbatches))
    again = plan_step(lengths.copy(), cost)  # deterministic: every rank may plan by itself
    assert again == plan


def test_flexsp_never_loses_to_its_homogeneous_special_case() -> None:
    cost = _h100()
    rng = np.random.default_rng(2)
    for distribution in ("wikipedia", "wlb_llm_like"):
        lengths = sample_lengths(distribution, 256, max_length=131072, rng=rng)
        flex = plan_step(lengths, cost).predicted_time_s
        for degree in (8, 16, 32):
            static = plan_step(lengths, cost, fixed_degree=degree)
            assert {g.degree for mb in static.microbatches for g in mb.groups} == {degree}
            assert flex <= static.predicted_time_s * 1.001


def test_bad_inputs_are_one_line_plan_errors() -> None:
    cost = _h100()
    for bad, field in (([], "lengths"), ([5, 0], "lengths"), ([10**7], "sequence length")):
        with pytest.raises(PlanError, match=field) as info:
            plan_step(bad, cost)
        assert "\n" not in str(info.value)
    with pytest.raises(PlanError, match="fixed degree 3"):
        plan_step([100], cost, fixed_degree=3)
    with pytest.raises(PlanError, match="max_evals"):
        PlannerOptions(max_evals=-1)


def _brute_force(lengths: list[int], cost: FlexSPCostModel) -> float:
    """Best micro-batch time over every multiset and every assignment (tiny instances)."""
    best = np.inf
    for counts in enumerate_multisets(cost.num_gpus, cost.degrees):
        group_degrees = [d for d, n in zip(cost.degrees, counts) for _ in range(n)]
        for choice in itertools.product(range(len(group_degrees)), repeat=len(lengths)):
            members: list[list[int]] = [[] for _ in group_degrees]
            for seq, g in enumerate(choice):
                members[g].append(lengths[seq])
            if any(sum(m) > d * cost.capacity_tokens for m, d in zip(members, group_degrees)):
                continue
            best = min(best, max(cost.group_time_s(m, d) for m, d in zip(members, group_degrees)))
    return cost.fixed_s_per_microbatch + best


def _small_cost(num_gpus: int) -> FlexSPCostModel:
    return cost_model_from_specs(model_preset("llama2-7b"), cluster_preset("dgx-h100"),
                                 num_gpus=num_gpus, max_degree=num_gpus)


def test_milp_matches_brute_force_on_tiny_instances() -> None:
    cost = _small_cost(4)
    rng = np.random.default_rng(3)
    for _ in range(4):
        lengths = sample_lengths("wlb_llm_like", 4, max_length=40000, rng=rng).tolist()
        exact = solve_microbatch_milp(lengths, cost, time_limit_s=20)
        assert exact.optimal
        # HiGHS proves optimality to a relative gap of 1e-4
        assert exact.time_s == pytest.approx(_brute_force(lengths, cost), rel=2e-4)
        assert sorted(i for _, ids in exact.groups for i in ids) == list(range(4))


def test_fast_planner_within_five_percent_of_proven_milp_optimum() -> None:
    cost = _small_cost(8)
    rng = np.random.default_rng(4)
    checked = 0
    for distribution in ("wikipedia", "wlb_llm_like", "github_like"):
        for _ in range(2):
            lengths = sample_lengths(distribution, 8, max_length=65536, rng=rng)
            if lengths.sum() > cost.num_gpus * cost.capacity_tokens:
                continue  # needs two micro-batches; the MILP plans one
            exact = solve_microbatch_milp(lengths, cost, time_limit_s=20)
            fast = plan_step(lengths, cost, PlannerOptions(extra_microbatches=0))
            if exact.optimal and len(fast.microbatches) == 1:
                assert fast.predicted_time_s <= exact.time_s * 1.05
                assert fast.predicted_time_s >= exact.bound_s * (1 - 1e-6)  # MILP is a bound
                checked += 1
    assert checked >= 4


def test_length_sampler_follows_the_quantile_table() -> None:
    rng = np.random.default_rng(5)
    wiki = sample_lengths("wikipedia", 200_000, max_length=2_000_000, rng=rng)
    # table: p10 87, p50 347, p90 2112, p99 10919 (sampling noise well under 5%)
    for q, expect in ((10, 87), (50, 347), (90, 2112), (99, 10919)):
        assert np.percentile(wiki, q) == pytest.approx(expect, rel=0.05)
    capped = sample_lengths("github_like", 512, max_length=32768, rng=rng)
    assert capped.max() <= 32768 and capped.min() >= 1 and capped.size == 512
    a = sample_lengths("wlb_llm_like", 64, max_length=1 << 17, rng=np.random.default_rng(9))
    b = sample_lengths("wlb_llm_like", 64, max_length=1 << 17, rng=np.random.default_rng(9))
    assert (a == b).all()
    with pytest.raises(PlanError, match="--distribution"):
        sample_lengths("books", 4, max_length=100, rng=rng)


def test_plan_ahead_yields_the_same_plans_in_order() -> None:
    from megatron_ext.planner.flexsp.prefetch import plan_ahead

    cost = _h100()
    rng = np.random.default_rng(6)
    batches = [sample_lengths("wikipedia", 64, max_length=65536, rng=rng) for _ in range(3)]
    got = list(plan_ahead(batches, cost))
    assert [list(lengths) for lengths, _ in got] == [list(b) for b in batches]
    assert [plan for _, plan in got] == [plan_step(b, cost) for b in batches]
    with pytest.raises(PlanError, match="sequence length"):
        list(plan_ahead([[10**7]], cost))


def test_cost_model_for_a_plan_file_uses_its_flexsp_section() -> None:
    import dataclasses

    from megatron_ext.plan import FlexSPConfig, LayerStrategy, ParallelPlan
    from megatron_ext.planner.flexsp.cost import cost_model_for_plan

    model = model_preset("llama2-7b")
    plan = ParallelPlan(world_size=16, pp=1, stages=((0, model.num_layers),),
                        layers=(LayerStrategy(dp=16),) * model.num_layers, model=model,
                        micro_batch_size=16, global_batch_size=16, seq_length=4096,
                        flexsp=FlexSPConfig(max_group_size=8, min_group_size=2),
                        cluster=cluster_preset("dgx-h100", num_nodes=2))
    cost = cost_model_for_plan(plan)
    assert cost.num_gpus == 16 and cost.degrees == (2, 4, 8)
    with pytest.raises(PlanError, match="flexsp section and a cluster"):
        cost_model_for_plan(dataclasses.replace(plan, cluster=None))


def test_cli_plans_and_reports_bad_input_in_one_line(tmp_path, capsys) -> None:
    import json

    from megatron_ext.cli import main
    from megatron_ext.planner.flexsp import StepPlan

    out = tmp_path / "plan.json"
    assert main(["flexsp", "plan", "--distribution", "wlb_llm_like", "--gpus", "16",
                 "--num-sequences", "64", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "micro-batches, predicted" in err and "vs best static" in err
    plan = StepPlan.from_dict(json.loads(out.read_text()))
    assert plan.num_gpus == 16 and len(plan.lengths) == 64
    assert main(["flexsp", "plan", "--distribution", "books"]) == 2
    too_long = tmp_path / "lengths.txt"
    too_long.write_text("100 2000\n900000\n")
    assert main(["flexsp", "plan", "--lengths", str(too_long), "--no-static"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("megatron-ext")]
    assert len(lines) == 2 and "--distribution='books'" in lines[0]
    assert "sequence length 900000" in lines[1]


def test_spilling_level_search_fills_the_long_sequences_group() -> None:
    # wikipedia 384K, 64 GPUs (the benchmark's 4th batch): an 87K sequence needs a 32-GPU group
    # to finish near the average load and leaves ~0.5 s of it idle; the spilling level search
    # puts the next-longest sequences there instead of opening groups for them.
    cost = _h100()
    rng = np.random.default_rng(zlib.crc32(b"wikipedia/393216/64"))
    lengths = [sample_lengths("wikipedia", 512, max_length=393216, rng=rng) for _ in range(4)][-1]
    desc = np.sort(lengths)[::-1]
    problem = make_problem(desc, cost)
    cands = microbatch_candidates(problem, 64, max_evals=0, big_fraction=0.25, level_pack=True)
    assert cands.level_s is not None
    spilled = level_pack_search(problem, 64, cands.num_big, cands.lower_bound_s, spill=True,
                                below=cands.level_s)
    assert spilled is not None
    state, level = spilled
    assert level < cands.level_s / 1.01  # strictly below the plain search's level
    assert (state.seq_group >= 0).all()
    assert (state.tokens <= cost.capacity_tokens * problem.degrees[state.group_deg_idx]).all()
    # a long sequence now shares the 87K sequence's group beyond its own smallest fast degree
    longest_group = state.seq_group[0]
    assert (state.seq_group[1:cands.num_big] == longest_group).any()
    plain = plan_step(lengths, cost, PlannerOptions(spill_pack=False))
    plan = plan_step(lengths, cost)
    plan.check(capacity_tokens=cost.capacity_tokens)
    # same cut, one more candidate: never slower; on this batch 0.8% faster (1.6956 -> 1.6813 s)
    assert plan.predicted_time_s < plain.predicted_time_s * 0.995
