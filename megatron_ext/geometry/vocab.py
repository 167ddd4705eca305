"""Where the vocabulary passes of a heterogeneous plan sit on each pipeline stage.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden, S = ranks per stage,
vtp = plan.vocab.tp, R = pp * vtp vocabulary shards.

Under vocab.mode = vocab_parallel every stage holds the same activation layout for the vocabulary
passes, `vocab_parallel_layout(plan)`: vtp ranks replicate a block (tp without sp, the
`[s, b, h]` block the passes expect), the other S / vtp ranks split the batch as far as the
micro-batch allows and the sequence for the rest. Local rank `k*vtp + t` of every stage belongs
to vocabulary replica k (runtime/vocab/comm.py `vocab_rank_lists`), so the R ranks of one
replica hold the same tokens on every stage: the first stage's block is that replica's summed
input embedding, the last stage's the final-norm output its output passes read. The transformer
body re-layouts from / to it (runtime/redistribute.py).
"""

from __future__ import annotations

from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.plan import ParallelPlan
from megatron_ext.plan_checks import vocab_parallel_split

__all__ = ["vocab_parallel_layout", "vocab_stage_roots"]


def vocab_parallel_layout(plan: ParallelPlan) -> ActivationLayout:
    """Layout of the summed input embedding (first stage), the final-norm output (last stage)
    and the vocabulary weights' replicas (every stage)."""
    dp, seq = vocab_parallel_split(
        stage_width=plan.stage_width,
        vocab_tp=plan.vocab.tp,
        micro_batch_size=plan.micro_batch_size,
        seq_length=plan.seq_length,
    )
    return ActivationLayout(tp=plan.vocab.tp, sp=False, ulysses=seq, dp=dp)


def vocab_stage_roots(plan: ParallelPlan) -> tuple[int, int]:
    """(first_stage_root, last_stage_root): vocabulary-group ranks of the first and the last
    stage's tp-rank-0 member of a replica (shard = stage * vtp + tp rank)."""
    return 0, (plan.pp - 1) * plan.vocab.tp
