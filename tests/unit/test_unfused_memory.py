"""planner/cost/memory.py's unfused term: what the unfused local layers (the CPU runtime, no
Transformer Engine) keep beyond the fused-kernel activation formula, against the saved tensors
listed one by one from the layers' shapes (tools/bench_memory.py measures the same tensors on
the runtime: every activation term within 0.01%)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.planner.cost.memory import layer_activation_bytes, unfused_activation_bytes
from megatron_ext.specs import ModelSpec

GQA = ModelSpec(name="gqa", num_layers=2, hidden_size=128, ffn_hidden_size=352,
                num_attention_heads=4, num_query_groups=2, vocab_size=512,
                max_position_embeddings=256)
MHA = ModelSpec(name="mha", num_layers=2, hidden_size=192, ffn_hidden_size=512,
                num_attention_heads=6, num_query_groups=6, vocab_size=512,
                max_position_embeddings=256)


def saved_tensors(model: ModelSpec, *, b: int, s: int, t: int, sp: bool, recompute: str,
                  dropout: bool) -> int:
    """Bytes the unfused fp32 layer saves, tensor by tensor (the bench's list, per layer)."""
    e, h, f, a = 4, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    d = h // a
    q, kv = h, model.num_query_groups * d
    rows = b * s
    hid = rows // (t if sp else 1)  # rows of the [rows, h] tensors on one rank
    rope = s * d * 4  # one [s, 1, 1, d] fp32 table
    if recompute == "full":
        return e * hid * h + rope
    saved = [e * hid * h] * 6  # norm 1 in/normalised/out, norm 2 in/normalised/out
    saved += [4 * hid] * 2  # the norms' fp32 inverse RMS
    saved += [e * rows * q // t]  # projection input
    saved += [e * rows * 2 * f // t] + [e * rows * f // t] * 3  # fc1 out, gate, silu, product
    saved += [rope] * 4  # cos / sin of Q and K
    if dropout:
        saved += [e * hid * h] * 2  # hidden dropout noise
    if recompute == "selective":
        saved += [e * rows * (q + 2 * kv) // t]  # the QKV output, pinned by V's view
        saved += [e * rows * q // t, e * rows * kv // t]  # rotated Q and K
    elif kv < q:
        saved += [e * rows * q // t] * 3  # rotated Q, K and V expanded to the heads
    else:  # rotated Q and K; V is a view that pins the QKV output
        saved += [e * rows * q // t, e * rows * kv // t, e * rows * (q + 2 * kv) // t]
    if recompute == "none":
        scores = a // t * rows * s * e
        saved += [scores] * (3 if dropout else 1)  # softmax out (+ noise, dropped probs)
    return sum(saved)


@pytest.mark.parametrize("model", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [False, True])
def test_fused_formula_plus_unfused_term_is_what_the_layers_save(model, t, sp, recompute,
                                                                   dropout):
    b, s = 2, 64
    shape = dict(b=b, seq_length=s, tp=np.array([t]), sp=np.array([sp]), cp=np.array([1]),
                 ulysses=np.array([1]),
                 recompute=np.array([{"none": 0, "selective": 1, "full": 2}[recompute]]),
                 element_bytes=4, dropout=dropout)
    fused = layer_activation_bytes(model, flash_attention=False, **shape)[0]
    unfused = unfused_activation_bytes(model, **shape)[0]
    want = saved_tensors(model, b=b, s=s, t=t, sp=sp, recompute=recompute, dropout=dropout)
    assert fused + unfused == pytest.approx(want, rel=1e-12)
    assert unfused > 0


def test_the_gpu_formula_is_unchanged_by_the_term():
    """The cost model's GPU memory stays the fused-kernel formula: the unfused term is a separate
    function, not folded into layer_activation_bytes."""
    base = dict(b=1, seq_length=4096, tp=8, sp=True, cp=1, ulysses=1, recompute=0,
                element_bytes=2)
    h, t = 8192, 8
    model = ModelSpec(name="m", num_layers=1, hidden_size=h, ffn_hidden_size=28672,
                      num_attention_heads=64, num_query_groups=8, vocab_size=128256,
                      max_position_embeddings=8192)
    got = layer_activation_bytes(model, flash_attention=True, dropout=False, **base)
    rows, q, kv, f = 4096, h, 1024, 28672
    want = 2 * rows * (4 * h / t + (q + 2 * kv + q + 3 * f) / t) + 4 * rows * 64 / t
    assert got == pytest.approx(want)


@pytest.mark.parametrize("cp,ulysses", [(2, 1), (1, 2)])
def test_context_and_ulysses_attention_keep_no_scores(cp, ulysses):
    """Under CP or Ulysses the attention is blockwise (Transformer Engine's, which Megatron-LM's
    CP requires; this package's ring attention, which saves q, k, v, its output and the fp32
    log-sum-exp), so core attention keeps the log-sum-exp with or without the flash flag, and no
    attention-dropout noise; the RoPE tables cover the rank's own chunk, s / (cp u) rows
    (Ulysses rotates before its all-to-all). The selective case is the bench's list tensor by
    tensor (exact there); rel 1e-12: the same integer sums."""
    b, s, model = 4, 64, GQA
    shape = dict(b=b, seq_length=s, tp=np.array([1]), sp=np.array([False]),
                 cp=np.array([cp]), ulysses=np.array([ulysses]), element_bytes=4, dropout=False)
    rows = b * s // (cp * ulysses)
    lse = 4 * rows * model.num_attention_heads
    none = dict(shape, recompute=np.array([0]))
    flash = layer_activation_bytes(model, flash_attention=True, **none)[0]
    assert layer_activation_bytes(model, flash_attention=False, **none)[0] == flash
    sel = dict(shape, recompute=np.array([1]))
    assert (layer_activation_bytes(model, flash_attention=False, **none)[0]
            - layer_activation_bytes(model, flash_attention=False, **sel)[0]) == lse
    e, h, f = 4, model.hidden_size, model.ffn_hidden_size
    d = h // model.num_attention_heads
    kv = model.num_query_groups * d
    want = (6 * e * rows * h + 2 * 4 * rows + e * rows * h  # norms, inverse RMS, proj input
            + e * rows * 2 * f + 3 * e * rows * f  # fc1 out, gate, silu, product
            + 4 * (s // (cp * ulysses)) * d * 4  # RoPE tables of the rank's chunk
            + e * rows * (h + 2 * kv) + e * rows * (h + kv))  # QKV output, rotated Q and K
    got = (layer_activation_bytes(model, flash_attention=False, **sel)[0]
           + unfused_activation_bytes(model, **sel)[0])
    assert got == pytest.approx(want, rel=1e-12)


def mla_saved_tensors(model: ModelSpec, *, b: int, s: int, recompute: str) -> int:
    """Bytes an unfused fp32 MLA layer saves at tp 1 without SP or dropout, tensor by tensor as
    the bench's hook lists them (megatron-core's MLASelfAttention with latent norms)."""
    mla = model.mla
    assert mla is not None
    e, h, f, n = 4, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    rows, d_q = b * s, mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if recompute == "full":
        return e * rows * h  # the layer input; MLA's rotary table is built inside attention
    saved = [e * rows * h] * 6 + [4 * rows] * 2  # layer norms: in / normalised / out, 1/RMS
    saved += [e * rows * n * mla.v_head_dim]  # projection input
    saved += [e * rows * 2 * f] + [e * rows * f] * 3  # fc1 out, gate, silu, product
    saved += [e * rows * n * d_q] * 2 + [e * rows * n * mla.v_head_dim]  # q, k^T, v
    saved += [e * rows * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)]  # KV down output
    saved += [e * rows * mla.kv_lora_rank] * 2 + [4 * rows]  # kv norm: normalised, out, 1/RMS
    if mla.q_lora_rank:  # q down output, q norm: normalised, out, 1/RMS
        saved += [e * rows * mla.q_lora_rank] * 3 + [4 * rows]
    saved += [4 * s * mla.qk_pos_emb_head_dim * 4]  # RoPE's four cos / sin tables
    if recompute == "none":
        saved += [e * b * n * s * s]  # softmax output
    return sum(saved)


@pytest.mark.parametrize("q_lora_rank,kv_lora_rank,v_head_dim", [(48, 32, 32), (None, 24, 16)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_mla_fused_formula_plus_unfused_term_is_what_the_layer_saves(q_lora_rank, kv_lora_rank,
                                                                     v_head_dim, recompute):
    """The bench's two MLA shapes (tools/bench_memory.py: exact there without SP); rel 1e-12:
    integer sums."""
    import dataclasses

    from megatron_ext.specs import MLASpec

    model = dataclasses.replace(
        GQA, num_query_groups=4, qk_layernorm=True,
        mla=MLASpec(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_head_dim=32,
                    qk_pos_emb_head_dim=16, v_head_dim=v_head_dim, rope_type="rope"))
    b, s = 2, 64
    shape = dict(b=b, seq_length=s, tp=np.array([1]), sp=np.array([False]), cp=np.array([1]),
                 ulysses=np.array([1]),
                 recompute=np.array([{"none": 0, "selective": 1, "full": 2}[recompute]]),
                 element_bytes=4, dropout=False)
    got = (layer_activation_bytes(model, flash_attention=False, **shape)[0]
           + unfused_activation_bytes(model, **shape)[0])
    assert got == pytest.approx(mla_saved_tensors(model, b=b, s=s, recompute=recompute),
                                rel=1e-12)


def moe_saved_tensors(*, rows: int, recv: int, experts: int, topk: int, f: int, swiglu: bool,
                      recompute: str) -> int:
    """Bytes the unfused fp32 MoE layer (GQA's attention, SequentialMLP) saves, as the bench
    lists them for one layer: the attention part as a dense layer's, then the router and the
    routed experts over `recv` rows (tools/bench_memory.py, exact at the measured rows)."""
    e, h = 4, GQA.hidden_size
    d = h // GQA.num_attention_heads
    q, kv, a = h, GQA.num_query_groups * d, GQA.num_attention_heads
    rope = 64 * d * 4
    saved = [e * rows * h] * 6 + [4 * rows] * 2  # norms: input, normalised, output; 1/RMS
    saved += [rope] * 4  # cos / sin of Q and K
    saved += [e * rows * q]  # projection input
    if recompute == "none":
        saved += [e * rows * q] * 3  # rotated Q, K and V expanded to the heads
        saved += [e * a * rows * 64]  # softmax output (rows = b s, s = 64)
    else:
        saved += [e * rows * (q + 2 * kv)]  # the QKV output, pinned by V's view
        saved += [e * rows * q, e * rows * kv]  # rotated Q and K
    saved += [8 * rows * topk, 4 * rows * topk]  # router: top-k indices, scores
    saved += [8 * recv, rows * experts, 4 * rows * experts]  # sort indices, map, probs
    saved += [e * recv * h, 4 * recv]  # fc1 input (the permuted tokens), permuted probs
    per_row = (2 * f + 3 * f) if swiglu else (f + f)  # fc1 out + gate, silu, product / act
    saved += [e * recv * (per_row + f)]  # ... + fc2 input
    return sum(saved)


@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_moe_fused_formula_plus_unfused_term_is_what_the_layer_saves(swiglu, recompute):
    """The bench's MoE layer at a measured routed-row count (R = 275 of T k = 256: imbalance
    enters as measured); rel 1e-12: integer sums."""
    import dataclasses

    from megatron_ext.plan import LayerStrategy
    from megatron_ext.planner.cost.moe import moe_activation_bytes, moe_unfused_bytes
    from megatron_ext.planner.space import StrategyTable
    from megatron_ext.specs import MoESpec

    model = dataclasses.replace(GQA, activation="swiglu" if swiglu else "gelu",
                                moe=MoESpec(num_experts=4, router_topk=2, ffn_hidden_size=96))
    table = StrategyTable.of([LayerStrategy(dp=2, ep=2, recompute=recompute)])
    shape = dict(b=2, seq_length=64, recv=275.0, element_bytes=4, dropout=False,
                 recompute=np.array([{"none": 0, "selective": 1}[recompute]]))
    got = (moe_activation_bytes(model, table, flash_attention=False, **shape)[0]
           + moe_unfused_bytes(model, table, **shape)[0])
    want = moe_saved_tensors(rows=128, recv=275, experts=4, topk=2, f=96, swiglu=swiglu,
                             recompute=recompute)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("element_bytes", [4, 2])
def test_vocabulary_layers_keep_the_ids_the_norm_inputs_and_one_fp32_softmax(element_bytes):
    """tp mode, one stage (pp 1), vocab tp 2, n tokens: the embedding's ids (int64) and
    out-of-shard mask (bool), the dropout mask [n/t, h] (1 byte), the final norm's and output
    layer's inputs [n/t, h], the loss's fp32 softmax [n, V/t] plus, in half precision, the
    logits it was cast from, its target mask (bool) and targets (int64)."""
    from megatron_ext.plan import VocabStrategy
    from megatron_ext.planner.cost.vocab import vocab_activation_bytes

    e, n, h, t = element_bytes, 256, GQA.hidden_size, 2
    v = GQA.vocab_size // t  # 512 is already a multiple of 128 t
    got = vocab_activation_bytes(GQA, VocabStrategy(mode="tp", tp=t), 1, float(n),
                                 np.ones(1, dtype=int), element_bytes=e, dropout=True,
                                 num_microbatches=1)[0]
    softmax = n * v * 4 + (n * v * e if e != 4 else 0)
    want = n * (8 + 1) + n * h // t + 2 * e * n * h // t + softmax + n * (1 + 8)
    assert got == pytest.approx(want, rel=1e-12)
