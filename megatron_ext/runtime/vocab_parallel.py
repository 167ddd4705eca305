"""Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary
Parallelism", MLSys 2025): public API of the device-agnostic runtime.

The input embedding and the output layer are split over all pipeline x tensor-parallel ranks
(padded; padded logits never enter the softmax). Every rank runs, per micro-batch, the passes
IF/IB (input embedding forward / backward) and S/T (output layer forward + fused input-gradient
GEMM / weight gradient); the softmax cross-entropy is reduced with the online max/sum-exp
rescaling, with one communication barrier (plan algorithm 1, p+1 micro-batches of activations)
or two (algorithm 2, p+2). `plan_vocab_schedule` places the passes into 1F1B; the
Megatron-facing schedule is megatron_ext/megatron_adapter/vocab/schedule.py.

Modules: partition (vocabulary split), output_layer / input_layer (math), comm (groups and
asynchronous-collective helpers), passes (per-iteration runner), schedule_ops / schedule_plan /
schedule_sim (pass order, placement, simulation), cost (analytic pass costs).
"""

from megatron_ext.runtime.vocab.comm import (
    GROUP_KINDS,
    VocabCommGroups,
    new_vocab_comm_groups,
    vocab_rank_lists,
)
from megatron_ext.runtime.vocab.cost import (
    baseline_pass_costs,
    layer_forward_flops,
    vocab_pass_costs,
)
from megatron_ext.runtime.vocab.input_layer import (
    EmbeddingLookup,
    accumulate_embedding_grad,
    embedding_forward_pass,
    flush_embedding_grad,
)
from megatron_ext.runtime.vocab.output_layer import (
    OutputShardState,
    TokenStats,
    combine_stats,
    finish_fused_input_grad,
    output_forward_pass,
    output_weight_grad_pass,
    softmax_scale,
)
from megatron_ext.runtime.vocab.partition import VocabPartition
from megatron_ext.runtime.vocab.passes import VocabPassRunner
from megatron_ext.runtime.vocab.schedule_ops import (
    Op,
    num_warmup,
    receive_window,
    skeleton_1f1b,
)
from megatron_ext.runtime.vocab.schedule_plan import plan_vocab_schedule
from megatron_ext.runtime.vocab.schedule_sim import (
    PassCosts,
    TimedOp,
    Timeline,
    simulate,
    simulate_baseline,
)

__all__ = [
    "GROUP_KINDS",
    "EmbeddingLookup",
    "Op",
    "OutputShardState",
    "PassCosts",
    "TimedOp",
    "Timeline",
    "TokenStats",
    "VocabCommGroups",
    "VocabPartition",
    "VocabPassRunner",
    "accumulate_embedding_grad",
    "baseline_pass_costs",
    "combine_stats",
    "embedding_forward_pass",
    "finish_fused_input_grad",
    "flush_embedding_grad",
    "layer_forward_flops",
    "new_vocab_comm_groups",
    "num_warmup",
    "output_forward_pass",
    "output_weight_grad_pass",
    "plan_vocab_schedule",
    "receive_window",
    "simulate",
    "simulate_baseline",
    "skeleton_1f1b",
    "softmax_scale",
    "vocab_pass_costs",
    "vocab_rank_lists",
]
