"""Analytic pass costs for placing the vocabulary passes (and for coarse predictions).

Legend: h = hidden, f = FFN hidden, s = sequence, n = tokens per micro-batch, V = padded vocab,
R = vocabulary-parallel ranks (pp x tp), L_k = transformer layers of stage k.
FLOPs per micro-batch, from the paper's Table 4 generalised to any FFN width:
  transformer layer forward   n (8 h^2 + 4 h f + 4 s h), backward 2x     (72h + 12s at f = 4h)
  S pass (1 barrier)          4 n h V / R    logits + the fused input-gradient GEMM  (2 barriers: 2)
  T pass (1 barrier)          2 n h V / R    weight gradient                         (2 barriers: 4)
  softmax, exp and friends    ~ `elementwise_flops_per_logit` x n V / R, split S 2/3, T 1/3
  input embedding IF / IB     n h each (a lookup, an index-add)
Only ratios matter for placement, so the unit is arbitrary (`flops_per_s` turns it into time).
"""

from __future__ import annotations

from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.vocab.schedule_sim import PassCosts
from megatron_ext.specs import ModelSpec


def layer_forward_flops(hidden: int, ffn_hidden: int, seq_length: int, tokens: int) -> float:
    """One GPT layer's forward FLOPs for `tokens` tokens (GEMMs + attention with the full score
    matrix), by planner/cost/compute.py's formulas: n (8 h^2 + 4 h f + 4 s h)."""
    model = ModelSpec(name="vocab-cost", num_layers=1, hidden_size=hidden,
                      ffn_hidden_size=ffn_hidden, num_attention_heads=1, num_query_groups=1,
                      vocab_size=1, activation="gelu", max_position_embeddings=seq_length)
    gemm = C.layer_gemm_forward_flops(model, tokens, 1)
    attention = C.attention_forward_flops(model, tokens / seq_length, seq_length, 1, flash=False)
    return float(gemm + attention)


def vocab_pass_costs(
    *,
    layers_per_stage: tuple[int, ...],
    hidden: int,
    ffn_hidden: int,
    seq_length: int,
    tokens: int,
    padded_vocab: int,
    num_shards: int,
    num_barriers: int,
    flops_per_s: float = 1.0,
    elementwise_flops_per_logit: float = 8.0,
    comm_s: float = 0.0,
) -> PassCosts:
    """Pass costs of vocabulary-parallel 1F1B; `comm_s` is charged to every collective/P2P."""
    layer_f = layer_forward_flops(hidden, ffn_hidden, seq_length, tokens)
    shard = tokens * padded_vocab / num_shards  # logits per rank and micro-batch
    gemm = 2.0 * hidden * shard
    elementwise = elementwise_flops_per_logit * shard
    s_flops = (2 if num_barriers == 1 else 1) * gemm + 2 * elementwise / 3
    t_flops = (1 if num_barriers == 1 else 2) * gemm + elementwise / 3
    return PassCosts(
        forward_s=tuple(n * layer_f / flops_per_s for n in layers_per_stage),
        backward_s=tuple(2 * n * layer_f / flops_per_s for n in layers_per_stage),
        output_forward_s=s_flops / flops_per_s,
        output_backward_s=t_flops / flops_per_s,
        loss_s=tokens / flops_per_s,
        input_forward_s=tokens * hidden / flops_per_s,
        input_backward_s=tokens * hidden / flops_per_s,
        p2p_s=comm_s, broadcast_s=comm_s, all_gather_s=comm_s, all_reduce_s=comm_s,
    )


def baseline_pass_costs(
    *,
    layers_per_stage: tuple[int, ...],
    hidden: int,
    ffn_hidden: int,
    seq_length: int,
    tokens: int,
    padded_vocab: int,
    tp: int = 1,
    flops_per_s: float = 1.0,
    elementwise_flops_per_logit: float = 8.0,
    comm_s: float = 0.0,
) -> PassCosts:
    """Megatron's layout: embedding inside stage 0, output layer + loss inside the last stage
    (split over `tp` ranks), for simulate_baseline."""
    layer_f = layer_forward_flops(hidden, ffn_hidden, seq_length, tokens)
    logits = tokens * padded_vocab / tp
    out_f = 2.0 * hidden * logits + 2 * elementwise_flops_per_logit * logits / 3
    out_b = 4.0 * hidden * logits + elementwise_flops_per_logit * logits / 3
    fwd = [n * layer_f for n in layers_per_stage]
    bwd = [2 * n * layer_f for n in layers_per_stage]
    fwd[0] += tokens * hidden
    bwd[0] += tokens * hidden
    fwd[-1] += out_f
    bwd[-1] += out_b
    return PassCosts(
        forward_s=tuple(x / flops_per_s for x in fwd),
        backward_s=tuple(x / flops_per_s for x in bwd),
        p2p_s=comm_s,
    )
