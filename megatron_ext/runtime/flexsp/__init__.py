"""FlexSP runtime (torch.distributed, device-agnostic, groups passed explicitly).

groups.FlexSPGroups (aligned power-of-two group pool, built once), ulysses (packed all-to-all,
GQA-aware), attention (varlen attention: flash-attn or pure torch), dispatch (plan -> this
rank's token rows), documents (samples cut at EOD into sequences), step (token-level loss,
micro-batch loop with a no_sync hook, and a plain gradient all-reduce for non-DDP models).
"""

from megatron_ext.runtime.flexsp.attention import (
    ulysses_varlen_attention,
    varlen_attention,
)
from megatron_ext.runtime.flexsp.dispatch import (
    RankMicroBatch,
    dispatch_sequences,
    position_ids,
    rank_microbatches,
    round_robin_owners,
)
from megatron_ext.runtime.flexsp.documents import split_documents
from megatron_ext.runtime.flexsp.groups import FlexSPGroups
from megatron_ext.runtime.flexsp.step import (
    allreduce_gradients,
    global_token_count,
    run_microbatches,
)
from megatron_ext.runtime.flexsp.ulysses import (
    check_ulysses_degree,
    heads_to_seq,
    seq_to_heads,
)

__all__ = [
    "FlexSPGroups",
    "RankMicroBatch",
    "allreduce_gradients",
    "check_ulysses_degree",
    "dispatch_sequences",
    "global_token_count",
    "heads_to_seq",
    "position_ids",
    "rank_microbatches",
    "round_robin_owners",
    "run_microbatches",
    "seq_to_heads",
    "split_documents",
    "ulysses_varlen_attention",
    "varlen_attention",
]
