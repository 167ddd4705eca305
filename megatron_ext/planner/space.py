"""The search space: legal per-layer strategies and vocabulary layouts, and the pruning rules.

Pruning rules (each says whether it is exact, i.e. can never discard the optimum of the cost
model, or a heuristic that the uniform Megatron baseline obeys as well):

R1 legality (exact): tp divides heads and query groups; sp needs tp > 1; ulysses * tp divides the
   query groups; cp, ulysses and (tp under sp) cut the sequence evenly (2*cp chunks for CP);
   tp * cp * ulysses * dp = ranks per stage; dp divides the micro-batch (samples over replicas).
   These are the plan validator's rules: anything else could not be emitted.
R2 tensor parallelism stays inside one node (heuristic, Megatron-LM's own guidance and Galvatron's
   decision tree): TP moves 4 activations per layer per micro-batch on the critical path; across
   nodes that is ~8x slower than NVLink.
R3 a sequence shard keeps >= 256 tokens per rank (heuristic): below that, per-layer CP/Ulysses
   latency dominates any memory gain.
R4 ZeRO level is only a choice when d = dp * cp * ulysses > 1 (exact: with d = 1 all levels cost
   the same); the layerwise search keeps zero=1 there so the vocabulary-layer rule ("distributed
   optimizer iff some layer uses zero >= 1") is met.
R5 with flash attention, selective recomputation is dropped in the layerwise space (heuristic,
   almost exact): it saves only the fp32 log-sum-exp (4 * a/t bytes per token, ~0.05% of the
   layer's activations) and costs one more attention forward.
R6 dominance (exact, `dominated`): drop s if some s' is no slower in the DP objective, keeps no
   more state, activation and transient memory, and costs no more to switch to or from any other
   strategy. Replacing s by s' in any solution then keeps every stage within memory and does not
   raise the objective, so an optimum without s exists. For MoE models the components of both
   layer kinds are compared side by side (inf where a kind may not use a strategy).
R7 MoE models (`expert_variants`): MoE layers also get every strategy with ep > 1 dividing the
   experts and ep * etp the stage width, etp in {tp, 1} (heuristic only in leaving out other
   etp values, which Megatron-LM's MoE recipes do not use); ep = 1 with etp != tp is left out
   (megatron-core 0.16.1 never reduces those expert gradients over expert-DP).
R8 multi-latent attention (exact, legality): tp divides the heads (R1; the latent down
   projections are replicated or gathered, so they set no rule); no Ulysses, since TE's CP
   attention with q/k and v head widths that differ takes only p2p / a2a+p2p and megatron_ext's
   Ulysses attention assumes one width: MLA layers use cp (ring, p2p) for long sequences.
R9 (search.py) MoE models: transient-memory levels rounded up to 1/64 of the cap (heuristic: a
   stage may lose cap/64 of budget, which the exact repair pass gives back layer by layer).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy, VocabStrategy
from megatron_ext.plan_checks import vocab_parallel_split
from megatron_ext.planner.cost.memory import RECOMPUTE_CODES
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.specs import ModelSpec

if TYPE_CHECKING:  # cost/model.py imports this module
    from megatron_ext.planner.cost.model import LayerCosts

MIN_SEQUENCE_SHARD = 256
"""R3: fewest tokens of one sequence a rank keeps under cp * ulysses."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyTable:
    """S candidate strategies with their degrees as numpy arrays (for vectorised costs)."""

    strategies: tuple[LayerStrategy, ...]
    """The candidates, in a fixed order (ties in pruning keep the earlier one)."""
    tp: np.ndarray  # [S]
    sp: np.ndarray  # [S] bool
    cp: np.ndarray  # [S]
    ulysses: np.ndarray  # [S]
    dp: np.ndarray  # [S]
    zero: np.ndarray  # [S]
    recompute: np.ndarray  # [S], RECOMPUTE_CODES
    ep: np.ndarray  # [S] expert-parallel degree (MoE layers; 1 elsewhere)
    etp: np.ndarray  # [S] expert tensor-parallel degree, resolved (LayerStrategy.expert_tp)
    layout: np.ndarray
    """[S] id of the activation layout (tp, sp, cp, ulysses, dp): equal ids switch for free."""

    @classmethod
    def of(cls, strategies: tuple[LayerStrategy, ...] | list[LayerStrategy]) -> StrategyTable:
        strategies = tuple(strategies)

        def col(name: str, dtype: type = np.int64) -> np.ndarray:
            return np.array([getattr(s, name) for s in strategies], dtype=dtype).reshape(-1)

        keys = [(s.tp, s.sp, s.cp, s.ulysses, s.dp) for s in strategies]
        ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        return cls(
            strategies=strategies,
            tp=col("tp"),
            sp=col("sp", bool),
            cp=col("cp"),
            ulysses=col("ulysses"),
            dp=col("dp"),
            zero=col("zero"),
            recompute=np.array([RECOMPUTE_CODES[s.recompute] for s in strategies], dtype=np.int64),
            ep=col("ep"),
            etp=np.array([s.expert_tp for s in strategies], dtype=np.int64).reshape(-1),
            layout=np.array([ids[k] for k in keys], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.strategies)

    def subset(self, index: np.ndarray | list[int]) -> StrategyTable:
        return StrategyTable.of([self.strategies[i] for i in np.asarray(index, dtype=np.int64)])

    @property
    def shard_ranks(self) -> np.ndarray:
        """d: ranks that share (and reduce) one parameter shard's gradients: dp * cp * ulysses."""
        return self.dp * self.cp * self.ulysses

    @property
    def expert_dp(self) -> np.ndarray:
        """Replicas of each expert (MoE layers): tp * cp * ulysses * dp / (ep * etp)."""
        return self.tp * self.shard_ranks // (self.ep * self.etp)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layer_strategies(
    model: ModelSpec,
    training: TrainingSpec,
    *,
    width: int,
    nvlink_gpus: int,
    micro_batch_size: int,
    uniform: bool = False,
    uniform_fsdp: bool = False,
) -> StrategyTable:
    """Legal strategies of one layer on a stage of `width` ranks (rules R1-R5).

    uniform=True gives what stock Megatron-LM expresses: no Ulysses, ZeRO 0 or 1 (the distributed
    optimizer), every recompute mode; uniform_fsdp adds ZeRO-3 (Megatron-LM's --use-torch-fsdp2,
    which it allows only with pp=1)."""
    seq = training.seq_length
    out: list[LayerStrategy] = []
    for tp, cp, uly in product(divisors(width), repeat=3):
        if width % (tp * cp * uly) or tp > nvlink_gpus:
            continue
        if model.num_attention_heads % tp or model.num_query_groups % tp:
            continue
        if uly > 1 and (
            uniform or not training.allow_ulysses or model.num_query_groups % (tp * uly)
            or model.mla is not None  # R8
        ):
            continue
        if cp > 1 and (not training.allow_cp or seq % (2 * cp)):
            continue
        if seq % uly or (cp * uly > 1 and seq // (cp * uly) < MIN_SEQUENCE_SHARD):
            continue
        dp = width // (tp * cp * uly)
        if micro_batch_size % dp:
            continue
        base = _variants(tp, cp, uly, dp, seq, training, uniform, uniform_fsdp)
        out += base + expert_variants(model, base, width)
    return StrategyTable.of(out)


def expert_variants(model: ModelSpec, base: list[LayerStrategy], width: int
                    ) -> list[LayerStrategy]:
    """R7, MoE models: each strategy again with every expert layout an MoE layer may take:
    ep > 1 dividing num_experts with ep * etp dividing the stage width, etp in {tp, 1} (the
    dense strategy itself is ep = 1, etp = tp). ep = 1 with etp != tp is left out (megatron-core
    0.16.1 then skips the experts' gradient reduction, reference M1.6), and so are tp > 1
    without sp (MoE needs SP with TP) and ZeRO-2/3 (the layerwise runtime runs MoE layers with
    ZeRO 0/1 only). Only MoE layers take these (cost/moe.py valid_for)."""
    if model.moe is None:
        return []
    return list(_expert_variants(model.moe.num_experts, model.moe.expert_ffn_hidden_size(model),
                                 tuple(base), width))


@functools.lru_cache(maxsize=4096)
def _expert_variants(num_experts: int, f: int, base: tuple[LayerStrategy, ...], width: int
                     ) -> tuple[LayerStrategy, ...]:
    """expert_variants, cached: every micro-batch size of a pipeline degree asks again."""
    out = []
    for s in base:
        if (s.tp > 1 and not s.sp) or s.zero >= 2:  # MoE layers: SP with TP, ZeRO 0/1
            continue
        for ep in divisors(math.gcd(num_experts, width)):
            for etp in dict.fromkeys([None, 1] if s.tp > 1 else [None]):
                et = s.tp if etp is None else etp
                if ep == 1 or width % (ep * et) or f % et:
                    continue
                out.append(dataclasses.replace(s, ep=ep, etp=etp))
    return tuple(out)


def _variants(
    tp: int,
    cp: int,
    uly: int,
    dp: int,
    seq: int,
    training: TrainingSpec,
    uniform: bool,
    uniform_fsdp: bool = False,
) -> list[LayerStrategy]:
    d = dp * cp * uly
    if uniform:
        zeros = [1, 0, 3] if uniform_fsdp else [1, 0]
    elif d == 1:
        zeros = [1]
    else:
        zeros = [1, 2, 3, 0] if training.allow_zero3 else [1, 0]
    modes = ["none", "selective", "full"]
    if not uniform and training.flash_attention:
        modes = ["none", "full"]
    sps = [True, False] if tp > 1 and seq % tp == 0 else [False]
    return [
        LayerStrategy(
            tp=tp,
            sp=sp,
            cp=cp,
            ulysses=uly,
            dp=dp,
            zero=zero,
            recompute=mode,  # type: ignore[arg-type]
        )
        for sp in sps
        for zero in zeros
        for mode in modes
    ]


def dominated(
    costs: np.ndarray,  # [S, C] components, lower is better in each
    transition_s: np.ndarray | None,  # [S, S], transition_s[i, j] = cost of i followed by j
) -> np.ndarray:  # [S] bool
    """Rule R6: s_i is dropped when some s_j is <= in every component and every switch to or from
    any third strategy costs no more (ties keep the lower index). transition_s None: all switches
    are free (strategies of one layout), so only the components decide."""
    num = costs.shape[0]
    le = np.all(costs[:, None, :] <= costs[None, :, :], axis=-1)  # le[j, i]: j <= i everywhere
    np.fill_diagonal(le, False)
    if num > 1 and transition_s is not None:
        into = transition_s.T  # into[i, x] = cost of x -> i
        # switch[j, i]: for every x not in {i, j}: x -> j <= x -> i and j -> x <= i -> x;
        # checked only for the pairs already <= in every component, a chunk of pairs at a time
        jj, ii = np.nonzero(le)
        chunk = max(1, 4_000_000 // num)
        for lo in range(0, len(jj), chunk):
            j, i = jj[lo : lo + chunk], ii[lo : lo + chunk]
            ok = (into[j] <= into[i]) & (transition_s[j] <= transition_s[i])  # [P, S]
            rows = np.arange(len(j))
            ok[rows, i] = True
            ok[rows, j] = True
            bad = ~ok.all(axis=1)
            le[j[bad], i[bad]] = False
    strictly = le & ~le.T
    earlier = np.tril(np.ones((num, num), dtype=bool), k=-1).T  # earlier[j, i]: j < i
    return np.any(strictly | (le & le.T & earlier), axis=0)


def dominated_layouts(
    costs: np.ndarray,  # [S, C] components, lower is better in each
    transition_s: np.ndarray,  # [S, S], depends only on the layouts, 0 inside one
    layout: np.ndarray,  # [S] layout ids
) -> np.ndarray:  # [S] bool: member of a dropped layout
    """Rule R6 for whole layouts: layout A is dropped when another layout B has, for every member
    of A, a member no worse in every component, and switching between B and any third layout
    costs no more than between A and it. Replacing each A layer by its B counterpart then keeps
    memory, does not raise layer time, turns A-A and A-B switches into free B-B ones and makes no
    other switch dearer. Ties keep the layout seen first."""
    ids, first = np.unique(layout, return_index=True)
    rank = np.argsort(np.argsort(first))  # layouts numbered in order of first appearance
    group = rank[np.searchsorted(ids, layout)]  # [S]
    num = len(ids)
    gswitch = transition_s[np.ix_(first[np.argsort(first)], first[np.argsort(first)])]  # [G, G]
    # switch_ok[b, a]: for every x not in {a, b}: x->b <= x->a and b->x <= a->x
    into = gswitch[:, :, None] <= gswitch[:, None, :]  # [x, b, a]
    out = gswitch.T[:, :, None] <= gswitch.T[:, None, :]  # [x, b, a]: b->x <= a->x
    ok = into & out
    idx = np.arange(num)
    ok[idx, idx, :] = True  # x == b
    ok[idx, :, idx] = True  # x == a
    switch_ok = np.all(ok, axis=0)
    # cover[b, a]: every member of a has a member of b <= it in every component
    le = np.all(costs[:, None, :] <= costs[None, :, :], axis=-1)  # [j, i]: j <= i
    order = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(group[order]) != 0])
    by_b = np.logical_or.reduceat(le[order][:, order], starts, axis=0)  # [G, S]
    cover = np.logical_and.reduceat(by_b, starts, axis=1)  # [G, G]
    le_g = switch_ok & cover
    np.fill_diagonal(le_g, False)
    earlier = np.triu(np.ones((num, num), dtype=bool), k=1)  # earlier[b, a]: b seen before a
    drop_group = np.any((le_g & ~le_g.T) | (le_g & le_g.T & earlier), axis=0)
    return drop_group[group]


def vocab_options(
    model: ModelSpec,
    *,
    width: int,
    pp: int,
    nvlink_gpus: int,
    training: TrainingSpec,
    micro_batch_size: int,
    uniform_tp: int | None = None,
) -> list[VocabStrategy]:
    """Vocabulary layouts: tensor-parallel on the first/last stage (any tp inside the NVLink
    domain), or
    vocabulary parallelism over all pp x tp ranks when pp > 1, allowed, and the sequence splits
    over its replicas (plan_checks.vocab_parallel_split, the plan's own rule). uniform_tp pins
    Megatron's choice (vocabulary tp = layer tp, never vocabulary parallel). The vocabulary
    layers are built from megatron-core's TransformerConfig at their tp, which needs tp to divide
    the heads and query groups (plan_checks refuses other plans the same way)."""
    if uniform_tp is not None:
        return [VocabStrategy(mode="tp", tp=uniform_tp)]
    tps = [t for t in divisors(width) if t <= nvlink_gpus
           and model.num_attention_heads % t == 0 and model.num_query_groups % t == 0]
    out = [VocabStrategy(mode="tp", tp=t) for t in tps]
    if pp > 1 and training.allow_vocab_parallel:
        for t in tps:
            try:
                vocab_parallel_split(
                    stage_width=width,
                    vocab_tp=t,
                    micro_batch_size=micro_batch_size,
                    seq_length=training.seq_length,
                )
            except PlanError:
                continue
            out.append(VocabStrategy(mode="vocab_parallel", tp=t, algorithm=1))
    return out


def prune_strategies(
    costs: LayerCosts,
    objective: np.ndarray,
    switch: np.ndarray,
    layout: np.ndarray,
) -> np.ndarray:
    """Indices kept by rule R6: first inside each layout (switch costs are equal there), then
    across layouts with the switch costs compared."""
    comps = np.stack(
        [objective, costs.state_bytes, costs.activation_bytes, costs.transient_bytes], axis=1
    )
    return prune_components(comps, switch, layout)


def prune_components(comps: np.ndarray, switch: np.ndarray, layout: np.ndarray,
                     max_rounds: int | None = None) -> np.ndarray:
    """Rule R6 on [S, C] components (lower is better in each): for models with several layer
    kinds the components of every kind side by side, inf where a kind may not use a strategy.
    `max_rounds` stops the across-layout passes early (still exact: it only keeps more)."""
    first_pass: list[int] = []
    for lay in np.unique(layout):
        members = np.flatnonzero(layout == lay)
        drop = dominated(comps[members], None)  # one layout: every switch between them is free
        first_pass.extend(members[~drop].tolist())
    keep = np.array(sorted(first_pass), dtype=np.int64)
    rounds = 0
    while max_rounds is None or rounds < max_rounds:  # dropping a layout can make another one
        rounds += 1  # dominated: repeat to a fixed point
        kept = keep[~dominated_layouts(comps[keep], switch[np.ix_(keep, keep)], layout[keep])]
        kept = kept[~dominated(comps[kept], switch[np.ix_(kept, kept)])]
        if len(kept) == len(keep):
            return keep
        keep = kept
    return keep
