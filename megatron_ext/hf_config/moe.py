"""HuggingFace mixture-of-experts fields -> ModelSpec.moe (MoESpec, Megatron-LM's --num-experts
family): Mixtral, Qwen1.5/Qwen2-MoE, Qwen3-MoE, DeepSeek-MoE.

Expert count and width, top-k, shared experts (Qwen's gated one: --moe-shared-expert-gate;
DeepSeek's n of them: one MLP n times as wide), which layers are MoE (Qwen's
decoder_sparse_step/mlp_only_layers and DeepSeek's first_k_dense_replace/moe_layer_freq ->
--moe-layer-freq), routing (norm_topk_prob=false is Megatron's --moe-router-pre-softmax: softmax
over all experts, top-k, no renormalisation) and the load-balancing loss. Absent fields have
already been set to the config class's defaults (defaults.py).
"""

from __future__ import annotations

from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.hf_config.fields import MOE_FAMILIES


def moe_fields(data: dict[str, Any], num_layers: Any, where: str) -> dict[str, Any] | None:
    """The MoESpec fields (our names, as in a plan file) of an MoE family's config, or None when
    it has no experts (Qwen2-MoE's num_experts=0, a DeepSeek config without n_routed_experts)."""
    family = data.get("model_type")
    if family not in MOE_FAMILIES:
        return None
    d = {k: v for k, v in data.items() if v is not None}
    if not isinstance(num_layers, int) or num_layers < 1:
        return None  # ModelSpec reports the missing layer count
    if family == "mixtral":
        return _routing(d, where, experts="num_local_experts", ffn=0, shared=0, freq=1,
                        balancing=("aux_loss", d["router_aux_loss_coef"]), pre_softmax=False)
    if family in ("qwen2_moe", "qwen3_moe"):
        if not d.get("num_experts"):
            return None
        if family == "qwen3_moe" and d.get("shared_expert_intermediate_size"):
            raise PlanError(f"{where} shared_expert_intermediate_size="
                            f"{d['shared_expert_intermediate_size']}: Qwen3-MoE has no shared "
                            "expert; this config is not one megatron_ext can read")
        step, only = d["decoder_sparse_step"], d.get("mlp_only_layers", [])
        if not isinstance(step, int) or step < 1 or not isinstance(only, list):
            raise PlanError(f"{where} decoder_sparse_step={step!r} / mlp_only_layers={only!r}: "
                            "need an int >= 1 and a list of layer indices")
        # modeling_qwen2_moe.py: layer i is sparse iff i not in mlp_only_layers and
        # (i + 1) % decoder_sparse_step == 0; Megatron's int form is i % f == 0, so a list
        pattern = [int(i not in only and (i + 1) % step == 0) for i in range(num_layers)]
        shared = d.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        return _routing(d, where, experts="num_experts", ffn=d["moe_intermediate_size"],
                        shared=shared, freq=1 if all(pattern) else pattern,
                        balancing=("aux_loss", d["router_aux_loss_coef"]),
                        pre_softmax=_pre_softmax(d, where), gate=bool(shared))
    # DeepSeek-MoE (configuration_deepseek.py / modeling_deepseek.py)
    if not d.get("n_routed_experts"):
        return None
    if d.get("num_nextn_predict_layers"):
        raise PlanError(f"{where} num_nextn_predict_layers={d['num_nextn_predict_layers']}: "
                        "multi-token prediction (MTP) is not supported by megatron_ext")
    first, every = d["first_k_dense_replace"], d["moe_layer_freq"]
    if not isinstance(first, int) or not isinstance(every, int) or every < 1 or first < 0:
        raise PlanError(f"{where} first_k_dense_replace={first!r} / moe_layer_freq={every!r}: "
                        "need ints (>= 0, >= 1)")
    pattern = [int(i >= first and i % every == 0) for i in range(num_layers)]
    shared = d.get("n_shared_experts", 0) * d["moe_intermediate_size"]
    spec = _routing(d, where, experts="n_routed_experts", ffn=d["moe_intermediate_size"],
                    shared=shared, freq=1 if all(pattern) else pattern,
                    balancing=("seq_aux_loss" if d["seq_aux"] else "aux_loss",
                               d["aux_loss_alpha"]),
                    pre_softmax=_pre_softmax(d, where))
    spec.update(_deepseek_routing(d, spec, where))
    return spec


def _routing(d: dict[str, Any], where: str, *, experts: str, ffn: int, shared: int,
             freq: int | list[int], balancing: tuple[str, Any], pre_softmax: bool,
             gate: bool = False) -> dict[str, Any]:
    topk = d.get("num_experts_per_tok")
    if not isinstance(topk, int) or topk < 1:
        raise PlanError(f"{where} num_experts_per_tok={topk!r}: an MoE config needs the experts "
                        "per token (>= 1)")
    return {
        "num_experts": d.get(experts), "router_topk": topk, "ffn_hidden_size": ffn,
        "shared_expert_intermediate_size": shared, "shared_expert_gate": gate,
        "layer_freq": freq, "router_load_balancing_type": balancing[0],
        "aux_loss_coeff": float(balancing[1]), "router_pre_softmax": pre_softmax,
    }


def _pre_softmax(d: dict[str, Any], where: str) -> bool:
    """norm_topk_prob with softmax routing: true renormalises the top-k of the softmax, which is
    Megatron's default (softmax over the chosen logits); false keeps the top-k softmax weights as
    they are, Megatron's --moe-router-pre-softmax (megatron-core moe_utils.py:608)."""
    norm = d.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise PlanError(f"{where} norm_topk_prob={norm!r} must be true or false")
    return not norm


def _deepseek_routing(d: dict[str, Any], spec: dict[str, Any], where: str) -> dict[str, Any]:
    """scoring_func, topk_method with its groups, routed_scaling_factor."""
    out: dict[str, Any] = {}
    score = d["scoring_func"]
    if score not in ("softmax", "sigmoid"):
        raise PlanError(f"{where} scoring_func={score!r}: Megatron-LM routes with softmax or "
                        "sigmoid scores only")
    if score == "sigmoid":
        if spec["router_pre_softmax"] and spec["router_topk"] > 1:
            raise PlanError(f"{where} scoring_func='sigmoid' with norm_topk_prob=false: "
                            "megatron-core always renormalises sigmoid top-k weights")
        out.update(router_score_function="sigmoid", router_pre_softmax=False)
    method = d.get("topk_method", "greedy")
    groups, keep = d.get("n_group") or 1, d.get("topk_group") or 1
    if method == "noaux_tc":
        if score != "sigmoid":
            raise PlanError(f"{where} topk_method='noaux_tc' needs scoring_func='sigmoid' "
                            "(megatron-core's expert bias is sigmoid-only)")
        out.update(router_enable_expert_bias=True)
    elif method == "group_limited_greedy":
        if spec["router_topk"] != keep:
            raise PlanError(f"{where} topk_method='group_limited_greedy' with "
                            f"num_experts_per_tok={spec['router_topk']}, topk_group={keep}: "
                            "DeepSeek scores a group by its best expert, megatron-core by the "
                            "sum of its top topk/topk_group; they agree only when those are "
                            "equal")
    elif method != "greedy":
        raise PlanError(f"{where} topk_method={method!r}: use greedy, group_limited_greedy or "
                        "noaux_tc")
    if method != "greedy" and groups > 1:
        out.update(router_num_groups=groups, router_group_topk=keep)
    factor = d.get("routed_scaling_factor", 1.0)
    if factor != 1.0:
        out.update(router_topk_scaling_factor=float(factor))
    return out


def moe_notes(data: dict[str, Any]) -> list[str]:
    """What an MoE config leaves implicit or to the training run."""
    notes = []
    if data.get("router_jitter_noise"):
        notes.append(f"router_jitter_noise: {data['router_jitter_noise']} is a training-time "
                     "regularizer; pass --moe-input-jitter-eps to pretrain_gpt.py")
    if data.get("topk_method", "greedy") == "greedy" and (data.get("n_group") or 1) > 1:
        notes.append("n_group / topk_group: unused by topk_method greedy")
    return notes
