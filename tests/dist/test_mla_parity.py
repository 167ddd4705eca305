"""Multi-latent attention (MLA) plans on 4 gloo ranks against a single-process megatron-core
GPTModel with MLA layers (tests/dist/mla_parity.py).

Each plan trains 5 optimizer steps (AdamW, clip 1.0, weight decay) on one fixed global batch:
per-step losses equal the single-process run with the same initial weights, and every local
gradient shard (the latent down projections, their norms, the head-split up projections and the
output projection) equals the reference's after step 1. Two models: YaRN RoPE with query
compression (q_lora_rank), and plain RoPE without it (linear_q_proj); q/k head width 12 (8 + 4
RoPE channels) differs from the value head width 6, as in DeepSeek (192 vs 128).

Tolerances (fp32), as the dense parity test: losses rtol 1e-5, gradients rtol 1e-4 / atol 1e-6.
The runs differ only in summation order (TP partial sums of the row-parallel projection, the
all-gather of the column-parallel latents, DP reductions), ~1e-7 relative; a head split wrongly,
a latent gathered in the wrong order or a missing TP reduction of the replicated norms' grads
is >= 1e-3.

One spawn checks every plan and the parameter count (a spawn costs 15-40 s on CI).
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


def mla_model(**mla: object):
    """tiny-llama (hidden 64, 4 heads, 4 layers, SwiGLU) with MLA and its latent norms."""
    from megatron_ext.presets import MODEL_PRESETS
    from megatron_ext.specs import MLASpec

    fields = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4,
              "v_head_dim": 6, "rope_type": "yarn", "rotary_scaling_factor": 4.0,
              "mscale": 0.707, "mscale_all_dim": 0.707, **mla}
    return dataclasses.replace(MODEL_PRESETS["tiny-llama"], name="tiny-mla", num_query_groups=4,
                               qk_layernorm=True, mla=MLASpec(**fields))  # type: ignore[arg-type]


def plans() -> dict:
    from tests.dist.runtime_parity import make_plan

    yarn, plain = mla_model(), mla_model(q_lora_rank=None, rope_type="rope",
                                         rotary_scaling_factor=1.0, mscale=1.0,
                                         mscale_all_dim=0.0)
    return {
        "tp2+sp dp2 (heads split), yarn": make_plan(
            yarn, [L(tp=2, sp=True, dp=2)] * 4, vocab=V(tp=2)),
        "pp2: tp2 / tp1 dp2 | tp2+sp / tp1 dp2 zero-1, yarn": make_plan(
            yarn, [L(tp=2), L(dp=2), L(tp=2, sp=True), L(dp=2, zero=1)], pp=2,
            stages=[(0, 2), (2, 4)], num_mb=4),
        "tp2 dp2 / dp4, no query compression, rope": make_plan(
            plain, [L(tp=2, dp=2), L(dp=4), L(tp=2, dp=2), L(dp=4)]),
    }


def query_norm_parameters(model) -> int:
    """The query norm megatron-core 0.19 adds without a query latent (compat.mla_normalises_query),
    which the cost model leaves out (hidden-sized per layer; docs/megatron-versions.md)."""
    from megatron_ext.megatron_adapter import compat

    assert model.mla is not None
    if model.mla.q_lora_rank is not None or not model.qk_layernorm:
        return 0
    if not compat.mla_normalises_query():
        return 0
    per_layer = 2 if model.normalization == "LayerNorm" else 1  # weight (and bias)
    return per_layer * model.hidden_size * model.num_layers


def _run_plans(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    from megatron_ext.geometry.vocab_partition import padded_vocab_size
    from megatron_ext.planner.cost.compute import model_parameters
    from tests.dist.mla_parity import parameter_count, reference_run
    from tests.dist.runtime_parity import run_plan

    out = {}
    for name, plan in plans().items():
        start = time.perf_counter()
        ref = reference_run(plan, steps=5, seed=11)
        result = run_plan(plan, ref=ref, seed=11, **TOLERANCES)
        padded = dataclasses.replace(plan.model, vocab_size=padded_vocab_size(
            plan.model.vocab_size, plan.vocab.tp, 128))
        result["params"] = (parameter_count(plan, 11),
                            model_parameters(padded) + query_norm_parameters(plan.model))
        out[name] = {**result, "seconds": time.perf_counter() - start}
    return out


def test_mla_parity_4_ranks() -> None:
    """TP2 + SP splitting MLA's heads (the latents gathered over TP); a pipelined heterogeneous
    plan; MLA without query compression on plain RoPE (on 0.19 with the query normalised in the
    local fused norm+linear, on both sides); and megatron-core's parameter count of each model
    equals the cost model's formula (planner/cost/mla.py) plus, on 0.19, that query norm."""
    results = run_distributed(_run_plans, world_size=4, timeout_s=900)
    for name, result in results[0].items():
        assert result["grads_compared"] > 0, name
        assert result["losses"][-1] < result["losses"][0] - 0.3, (name, result["losses"])
        counted, formula = result["params"]
        assert counted == formula, (name, counted, formula)
