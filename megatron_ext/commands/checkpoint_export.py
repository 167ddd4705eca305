"""`megatron-ext checkpoint export-hf DIR OUT`: a checkpoint as a HuggingFace Llama or Mixtral.

Reads the checkpoint's full tensors with torch.distributed.checkpoint in no-process-group mode
and writes `model.safetensors` + `config.json` that transformers' `LlamaForCausalLM` loads:
megatron-core's fused `linear_qkv` rows (per query group: its query heads, one key head, one
value head) become q/k/v_proj, `linear_fc1` ([gate; up]) becomes gate/up_proj, the fused
pre-norm weights become input/post_attention_layernorm, and the vocabulary padding rows are cut.
Dense Llama-family models, and mixture-of-experts models of Mixtral's shape (every layer MoE,
softmax top-k routing renormalised over the chosen experts, no shared experts, dropless), written
as `MixtralForCausalLM` in the hub's layout: the router becomes `block_sparse_moe.gate`, expert
e's rows of megatron-core's stacked `experts.experts.linear_fc1` ([E, gate; up, h]) become
`experts.e.w1` (gate) and `w3` (up), its `linear_fc2` `w2`. Megatron-LM's default routing
(top-k of the logits, then a softmax over those k) equals Mixtral's (a softmax over all experts,
top-k, renormalised). Anything else is one line naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_ext.errors import PlanError


def _full_tensors(ckpt: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(ckpt)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _check_model(model: dict[str, Any], where: str) -> None:
    wrong = {"activation": ("swiglu", model.get("activation")),
             "normalization": ("RMSNorm", model.get("normalization")),
             "position_embedding": ("rope", model.get("position_embedding")),
             "qk_layernorm": (False, model.get("qk_layernorm")),
             "rope_scaling": (False, model.get("rope_scaling")),
             "rotary_percent": (1.0, model.get("rotary_percent", 1.0))}
    for field, (want, got) in wrong.items():
        if got != want:
            raise PlanError(f"checkpoint export-hf: {where} has model.{field}={got!r}; export-hf "
                            f"writes Llama-family models ({field}={want!r}) only")
    moe = model.get("moe")
    if moe is None:
        return
    mixtral = {"layer_freq": 1, "shared_expert_intermediate_size": 0,
               "router_score_function": "softmax", "router_pre_softmax": False,
               "capacity_factor": 0.0, "router_topk_scaling_factor": 0.0,
               "router_num_groups": 0, "router_enable_expert_bias": False}
    for field, want in mixtral.items():
        got = moe.get(field, want)
        if got != want and not (field == "layer_freq" and isinstance(got, list)
                                and all(v == 1 for v in got)):
            raise PlanError(f"checkpoint export-hf: {where} has model.moe.{field}={got!r}; "
                            f"export-hf writes mixture-of-experts models of Mixtral's shape "
                            f"({field}={want!r}) only")
    if model.get("add_bias_linear") or model.get("add_qkv_bias"):
        raise PlanError(f"checkpoint export-hf: {where} has linear biases "
                        "(model.add_bias_linear / add_qkv_bias); Mixtral has none")


def hf_config(model: dict[str, Any]) -> dict[str, Any]:
    heads = model["num_attention_heads"]
    head_dim = model.get("kv_channels") or model["hidden_size"] // heads
    moe = model.get("moe")
    if moe is not None:  # transformers' MixtralConfig
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "hidden_size": model["hidden_size"],
                "intermediate_size": moe.get("ffn_hidden_size") or model["ffn_hidden_size"],
                "num_local_experts": moe["num_experts"],
                "num_experts_per_tok": moe["router_topk"],
                "router_aux_loss_coef": moe.get("aux_loss_coeff", 0.0),
                "output_router_logits": False, "sliding_window": None,
                "num_hidden_layers": model["num_layers"], "num_attention_heads": heads,
                "num_key_value_heads": model["num_query_groups"], "head_dim": head_dim,
                "vocab_size": model["vocab_size"],
                "max_position_embeddings": model["max_position_embeddings"],
                "rms_norm_eps": model["norm_epsilon"], "rope_theta": float(model["rotary_base"]),
                "tie_word_embeddings": bool(model["tied_embeddings"]), "hidden_act": "silu",
                "torch_dtype": "float32"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": model["hidden_size"], "intermediate_size": model["ffn_hidden_size"],
            "num_hidden_layers": model["num_layers"], "num_attention_heads": heads,
            "num_key_value_heads": model["num_query_groups"], "head_dim": head_dim,
            "vocab_size": model["vocab_size"],
            "max_position_embeddings": model["max_position_embeddings"],
            "rms_norm_eps": model["norm_epsilon"], "rope_theta": float(model["rotary_base"]),
            "tie_word_embeddings": bool(model["tied_embeddings"]),
            "attention_bias": bool(model["add_qkv_bias"]),
            "mlp_bias": bool(model["add_bias_linear"]), "hidden_act": "silu",
            "torch_dtype": "float32"}


def hf_tensors(tensors: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """megatron-core GPTModel keys -> HuggingFace Llama keys (module docstring)."""
    heads, groups = model["num_attention_heads"], model["num_query_groups"]
    head_dim = model.get("kv_channels") or model["hidden_size"] // heads
    vocab, per_group = model["vocab_size"], heads // groups
    out = {"model.embed_tokens.weight": tensors["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": tensors["decoder.final_layernorm.weight"]}
    if not model["tied_embeddings"]:
        out["lm_head.weight"] = tensors["output_layer.weight"][:vocab]
    for i in range(model["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = tensors[src + "self_attention.linear_qkv.weight"]
        qkv = qkv.reshape(groups, (per_group + 2) * head_dim, -1)
        q, k, v = qkv.split([per_group * head_dim, head_dim, head_dim], dim=1)
        out[dst + "self_attn.q_proj.weight"] = q.reshape(heads * head_dim, -1)
        out[dst + "self_attn.k_proj.weight"] = k.reshape(groups * head_dim, -1)
        out[dst + "self_attn.v_proj.weight"] = v.reshape(groups * head_dim, -1)
        out[dst + "self_attn.o_proj.weight"] = tensors[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = tensors[
            src + "self_attention.linear_qkv.layer_norm_weight"]
        if model.get("moe") is not None:
            out.update(_mixtral_experts(tensors, src, dst))
        else:
            gate, up = tensors[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
            out[dst + "mlp.down_proj.weight"] = tensors[src + "mlp.linear_fc2.weight"]
        out[dst + "post_attention_layernorm.weight"] = tensors[
            src + "mlp.linear_fc1.layer_norm_weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _mixtral_experts(tensors: dict[str, Any], src: str, dst: str) -> dict[str, Any]:
    """One MoE layer's router and experts in Mixtral's hub layout (module docstring)."""
    moe = dst + "block_sparse_moe."
    out = {moe + "gate.weight": tensors[src + "mlp.router.weight"]}
    fc1 = tensors[src + "mlp.experts.experts.linear_fc1.weight"]  # [E, 2 * ffn, h]
    fc2 = tensors[src + "mlp.experts.experts.linear_fc2.weight"]  # [E, h, ffn]
    for e in range(fc1.shape[0]):
        gate, up = fc1[e].chunk(2, dim=0)
        out[f"{moe}experts.{e}.w1.weight"], out[f"{moe}experts.{e}.w3.weight"] = gate, up
        out[f"{moe}experts.{e}.w2.weight"] = fc2[e]
    return out


def export_hf(ckpt: Path, common: dict[str, Any], out: str | Path) -> Path:
    """Write `out`/model.safetensors and config.json for the iteration directory `ckpt`
    (`common`: its common state; checkpoint.py's `run_export` finds both)."""
    from safetensors.torch import save_file

    from megatron_ext.megatron_adapter.training.checkpoint_files import find_damage

    damage = find_damage(ckpt)
    if damage is not None:
        raise PlanError(f"checkpoint export-hf: {ckpt} is damaged ({damage}); export an intact "
                        "iteration (pass its iter_NNNNNNN directory)")
    ext = common.get("megatron_ext") or {}
    if "plan" not in ext:
        raise PlanError(f"checkpoint export-hf: {ckpt} has no megatron_ext record (written by "
                        "Megatron-LM?); resume it once with pretrain_gpt.py and save")
    if ext.get("layer_keys") != "global":
        raise PlanError(f"checkpoint export-hf: {ckpt} stacks its layers into one tensor per "
                        "weight; resume it once with pretrain_gpt.py and save")
    model = json.loads(ext["plan"])["model"]
    _check_model(model, str(ckpt))
    tensors = _full_tensors(ckpt)
    try:
        converted = hf_tensors(tensors, model)
    except KeyError as err:
        raise PlanError(f"checkpoint export-hf: {ckpt} has no tensor {err}; it is not a "
                        "megatron-core GPTModel checkpoint of a Llama-family model") from None
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    save_file(converted, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(hf_config(model), indent=1) + "\n")
    return target
