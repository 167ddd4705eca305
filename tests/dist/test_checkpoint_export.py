"""`megatron-ext checkpoint export-hf`: a tiny Llama (GQA, untied) trained one step by the
layerwise runtime and saved by checkpoint.py, exported, and loaded by transformers'
LlamaForCausalLM: its logits equal the runtime's. fp32; tolerance 1e-4 absolute on logits of
magnitude ~1: only the attention and matmul kernels differ (~1e-6); a wrongly split q/k/v or
gate/up swaps whole rows and changes logits by O(0.1)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

ATOL = 1e-4  # see the module docstring


def _plan() -> Any:
    from megatron_ext.plan import LayerStrategy as L
    from megatron_ext.presets import MODEL_PRESETS
    from tests.dist.runtime_parity import make_plan

    return make_plan(MODEL_PRESETS["tiny-llama"], [L()] * 4, world=1, mbs=2, num_mb=1, seq=16)


def _train_and_save(rank: int, world_size: int, path: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch

    from tests.dist.test_checkpoint_resume import _save, _train, _trainer

    plan = _plan()
    backend, scheduler = _trainer(plan, seed=11)
    _train(backend, scheduler, plan, 1)
    _save(backend, scheduler, plan, path, 1)
    tokens = torch.randint(0, plan.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = backend.model[0].module(input_ids=tokens)
    return {"tokens": tokens, "logits": logits.float()}


def test_export_hf_logits_match_the_runtime(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    runtime = run_distributed(_train_and_save, world_size=1, timeout_s=600, path=str(ckpt))[0]
    result = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "checkpoint", "export-hf",
                             str(ckpt), str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(out), torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(runtime["tokens"]).logits
    vocab = model.config.vocab_size
    expected = runtime["logits"]  # [b, s, padded vocab]
    assert expected.shape[:2] == logits.shape[:2] and expected.shape[2] >= vocab
    torch.testing.assert_close(logits, expected[..., :vocab], rtol=0, atol=ATOL)


def test_export_hf_refuses_a_model_it_cannot_write(tmp_path: Path) -> None:
    from megatron_ext.commands.checkpoint_export import _check_model
    from megatron_ext.errors import PlanError

    with pytest.raises(PlanError, match=r"has model.normalization='LayerNorm'; export-hf writes "
                                        r"Llama-family models \(normalization='RMSNorm'\)"):
        _check_model({"activation": "swiglu", "normalization": "LayerNorm",
                      "position_embedding": "rope", "moe": None, "qk_layernorm": False,
                      "rope_scaling": False, "rotary_percent": 1.0}, "ckpt")


def _moe_plan() -> Any:
    from megatron_ext.plan import LayerStrategy as L
    from tests.dist.runtime_parity import make_plan
    from tests.dist.test_checkpoint_resume import _models

    return make_plan(_models()["moe"], [L()] * 4, world=1, mbs=2, num_mb=1, seq=16)


def _train_and_save_moe(rank: int, world_size: int, path: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch

    from tests.dist.test_checkpoint_resume import _save, _train, _trainer

    plan = _moe_plan()
    backend, scheduler = _trainer(plan, seed=11)
    _train(backend, scheduler, plan, 1)
    _save(backend, scheduler, plan, path, 1)
    tokens = torch.randint(0, plan.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(5))
    model = backend.model[0].module
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens)
    return {"tokens": tokens, "logits": logits.float()}


def test_export_hf_mixtral_logits_match_the_runtime(tmp_path: Path) -> None:
    """The tiny MoE (4 experts, top-2, every layer MoE) as MixtralForCausalLM: logits within
    ATOL. Both route each token by the same softmax-normalised top-2 (Mixtral's softmax over all
    experts renormalised equals Megatron's softmax over the top-k logits) and sum the same two
    expert outputs, fp32; a token whose 2nd and 3rd router logits tie within rounding could pick
    another expert, which the fixed seed avoids (the check would then fail by O(0.1))."""
    transformers = pytest.importorskip("transformers")
    import torch

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    runtime = run_distributed(_train_and_save_moe, world_size=1, timeout_s=600,
                              path=str(ckpt))[0]
    result = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "checkpoint", "export-hf",
                             str(ckpt), str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = transformers.MixtralForCausalLM.from_pretrained(
        str(out), torch_dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    with torch.no_grad():
        logits = model(runtime["tokens"]).logits
    vocab = model.config.vocab_size
    expected = runtime["logits"]
    assert expected.shape[:2] == logits.shape[:2] and expected.shape[2] >= vocab
    torch.testing.assert_close(logits, expected[..., :vocab], rtol=0, atol=ATOL)


def test_export_hf_refuses_an_moe_model_mixtral_cannot_hold() -> None:
    from megatron_ext.commands.checkpoint_export import _check_model
    from megatron_ext.errors import PlanError

    model = {"activation": "swiglu", "normalization": "RMSNorm", "position_embedding": "rope",
             "qk_layernorm": False, "rope_scaling": False, "rotary_percent": 1.0,
             "moe": {"num_experts": 4, "router_topk": 2, "shared_expert_intermediate_size": 64}}
    with pytest.raises(PlanError, match=r"has model.moe.shared_expert_intermediate_size=64; "
                                        r"export-hf writes mixture-of-experts models of "
                                        r"Mixtral's shape \(shared_expert_intermediate_size=0\)"):
        _check_model(model, "ckpt")
    _check_model({**model, "moe": {"num_experts": 4, "router_topk": 2}}, "ckpt")  # Mixtral's
