"""What a plan is made for: the model (ModelSpec) and the cluster (ClusterSpec, LinkSpec).

Pure data with JSON I/O; no torch. Units are suffixes: `_gib`, `_flops`, `_bytes_per_s`, `_s`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_ext.errors import PlanError
from megatron_ext.schema import (
    expect_object,
    get_bool,
    get_float,
    get_float_list,
    get_int,
    get_str,
    reject_unknown,
)

Activation = Literal["gelu", "swiglu"]
Normalization = Literal["LayerNorm", "RMSNorm"]
PositionEmbedding = Literal["rope", "learned_absolute"]
ScoreFunction = Literal["softmax", "sigmoid"]
RopeType = Literal["rope", "yarn"]
TokenDropPolicy = Literal["probs", "position"]
MAX_NUM_LAYERS = 100_000
"""Upper bound on ModelSpec.num_layers (the largest published models have a few hundred)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a GPT/Llama decoder-only model, in Megatron's terms."""

    name: str = "custom"
    """Preset name or a label for a custom model."""
    num_layers: int
    """Transformer layers (Megatron --num-layers)."""
    hidden_size: int
    """Model width h (--hidden-size)."""
    ffn_hidden_size: int
    """MLP inner width (--ffn-hidden-size); with swiglu, the width of each of the two branches."""
    num_attention_heads: int
    """Query heads a (--num-attention-heads)."""
    num_query_groups: int
    """Key/value heads (--num-query-groups); equal to num_attention_heads without GQA."""
    vocab_size: int
    """Tokenizer vocabulary before Megatron's padding to a multiple of 128 x tp."""
    kv_channels: int = 0
    """Per-head width (--kv-channels); 0 means hidden_size // num_attention_heads."""
    tied_embeddings: bool = False
    """Input embedding and output layer share one weight (Megatron's default; Llama unties)."""
    activation: Activation = "swiglu"
    """MLP activation: swiglu (Llama, --swiglu) or gelu (GPT-3)."""
    normalization: Normalization = "RMSNorm"
    """--normalization."""
    position_embedding: PositionEmbedding = "rope"
    """--position-embedding-type."""
    max_position_embeddings: int = 4096
    """--max-position-embeddings: the longest sequence the position embedding covers."""
    add_bias_linear: bool = False
    """Linear layers carry biases (GPT-3: yes; Llama: no). --disable-bias-linear is its negation."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2; --add-qkv-bias)."""
    qk_layernorm: bool = False
    """A norm on each head's queries and keys (Qwen3; --qk-layernorm)."""
    norm_epsilon: float = 1e-5
    """--norm-epsilon (Megatron's args.layernorm_epsilon)."""
    rotary_base: int = 10000
    """RoPE base theta (--rotary-base; HuggingFace rope_theta)."""
    rotary_percent: float = 1.0
    """Share of each head's channels that get RoPE (--rotary-percent; HF partial_rotary_factor)."""
    rope_scaling: bool = False
    """Llama 3.x RoPE frequency scaling (--use-rope-scaling)."""
    rope_scaling_factor: float = 8.0
    """Its factor (--rope-scaling-factor; Llama 3.1: 8, Llama 3.2: 32)."""
    moe: MoESpec | None = None
    """Mixture-of-Experts shape; None for a dense model."""
    mla: MLASpec | None = None
    """Multi-latent attention shape (--multi-latent-attention); None for standard attention."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise PlanError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.num_layers > MAX_NUM_LAYERS:
            # Plans hold one strategy per layer; an absurd count would exhaust memory, not fail.
            raise PlanError(
                f"model.num_layers={self.num_layers} exceeds the supported {MAX_NUM_LAYERS}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise PlanError(
                f"model.num_query_groups={self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}; use a divisor"
            )
        if not (0 < self.rotary_percent <= 1):
            raise PlanError(f"model.rotary_percent={self.rotary_percent} must be in (0, 1]")
        for name in ("norm_epsilon", "rope_scaling_factor"):
            if not getattr(self, name) > 0:
                raise PlanError(f"model.{name}={getattr(self, name)} must be > 0")
        if self.rotary_base < 1:
            raise PlanError(f"model.rotary_base={self.rotary_base} must be >= 1")
        if self.moe is not None:
            freq = self.moe.layer_freq
            if not isinstance(freq, int) and len(freq) != self.num_layers:
                raise PlanError(f"model.moe.layer_freq has {len(freq)} entries but num_layers="
                                f"{self.num_layers}; give one 1/0 per layer")
            if not any(self.is_moe_layer(i) for i in range(self.num_layers)):
                raise PlanError("model.moe.layer_freq makes no layer MoE; drop model.moe for a "
                                "dense model")
            if self.add_bias_linear:
                # megatron-core 0.16.1 mlp.py:247 fails on expert biases at EP=1; Megatron-LM's
                # MoE recipes all use --disable-bias-linear.
                raise PlanError("model.add_bias_linear=true with model.moe: megatron-core's "
                                "experts do not train with linear biases; use "
                                "--disable-bias-linear (add_bias_linear=false)")
        if self.mla is not None:
            self.mla.check_model(self)
        if (self.mla is None and self.kv_channels == 0
                and self.hidden_size % self.num_attention_heads):
            raise PlanError(
                f"model.hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels explicitly"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layer layer_idx (global, zero-based) has routed experts instead of a dense MLP."""
        return self.moe is not None and self.moe.is_moe_layer(layer_idx)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.moe is None:
            del data["moe"]  # dense plans keep their JSON unchanged
        else:
            data["moe"] = self.moe.to_dict()
        if self.mla is None:
            del data["mla"]  # standard-attention plans keep their JSON unchanged
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str = "model") -> ModelSpec:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        return cls(
            name=get_str(data, "name", path, default="custom"),
            num_layers=get_int(data, "num_layers", path, minimum=1),
            hidden_size=get_int(data, "hidden_size", path, minimum=1),
            ffn_hidden_size=get_int(data, "ffn_hidden_size", path, minimum=1),
            num_attention_heads=get_int(data, "num_attention_heads", path, minimum=1),
            num_query_groups=get_int(
                data, "num_query_groups", path, default=data.get("num_attention_heads"), minimum=1
            ),
            vocab_size=get_int(data, "vocab_size", path, minimum=1),
            kv_channels=get_int(data, "kv_channels", path, default=0, minimum=0),
            tied_embeddings=get_bool(data, "tied_embeddings", path, default=False),
            activation=get_str(data, "activation", path, default="swiglu",
                               choices=("gelu", "swiglu")),  # type: ignore[arg-type]
            normalization=get_str(data, "normalization", path, default="RMSNorm",
                                  choices=("LayerNorm", "RMSNorm")),  # type: ignore[arg-type]
            position_embedding=get_str(
                data, "position_embedding", path, default="rope",
                choices=("rope", "learned_absolute"),
            ),  # type: ignore[arg-type]
            max_position_embeddings=get_int(data, "max_position_embeddings", path, default=4096,
                                            minimum=1),
            add_bias_linear=get_bool(data, "add_bias_linear", path, default=False),
            add_qkv_bias=get_bool(data, "add_qkv_bias", path, default=False),
            qk_layernorm=get_bool(data, "qk_layernorm", path, default=False),
            norm_epsilon=get_float(data, "norm_epsilon", path, default=1e-5),
            rotary_base=get_int(data, "rotary_base", path, default=10000, minimum=1),
            rotary_percent=get_float(data, "rotary_percent", path, default=1.0),
            rope_scaling=get_bool(data, "rope_scaling", path, default=False),
            rope_scaling_factor=get_float(data, "rope_scaling_factor", path, default=8.0),
            moe=(MoESpec.from_dict(data["moe"], f"{path}.moe")
                 if data.get("moe") is not None else None),
            mla=(MLASpec.from_dict(data["mla"], f"{path}.mla")
                 if data.get("mla") is not None else None),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Mixture-of-Experts shape of a ModelSpec, in Megatron-LM's terms (`--num-experts`, ...).

    Defaults are Megatron-LM core_v0.16.1's flag defaults. Which layers are MoE follows
    `--moe-layer-freq`: an int f makes layer i MoE iff i % f == 0; a tuple gives 1 (MoE) or
    0 (dense) per layer (megatron/core/models/gpt/gpt_layer_specs.py:579-596)."""

    num_experts: int
    """Routed experts per MoE layer (--num-experts)."""
    router_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    ffn_hidden_size: int = 0
    """Each expert's FFN width (--moe-ffn-hidden-size); 0 means model.ffn_hidden_size."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared experts, all of them together (--moe-shared-expert-intermediate-size);
    0 means none."""
    layer_freq: int | tuple[int, ...] = 1
    """--moe-layer-freq: an int f (layer i is MoE iff i % f == 0) or one 1/0 per layer."""
    router_load_balancing_type: str = "aux_loss"
    """--moe-router-load-balancing-type: aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none."""
    aux_loss_coeff: float = 0.0
    """--moe-aux-loss-coeff."""
    z_loss_coeff: float = 0.0
    """--moe-z-loss-coeff; 0 means no z-loss."""
    router_score_function: ScoreFunction = "softmax"
    """--moe-router-score-function."""
    router_pre_softmax: bool = False
    """--moe-router-pre-softmax: softmax over all experts before top-k, no renormalisation."""
    capacity_factor: float = 0.0
    """--moe-expert-capacity-factor; 0 means dropless (Megatron's None)."""
    shared_expert_gate: bool = False
    """--moe-shared-expert-gate: a sigmoid gate on the shared experts' output (Qwen2-MoE)."""
    router_topk_scaling_factor: float = 0.0
    """--moe-router-topk-scaling-factor: multiplies the routing weights (DeepSeek's
    routed_scaling_factor); 0 means none (Megatron's None)."""
    router_num_groups: int = 0
    """--moe-router-num-groups: expert groups for group-limited routing; 0 means none."""
    router_group_topk: int = 0
    """--moe-router-group-topk: groups each token may use; 0 means none."""
    router_enable_expert_bias: bool = False
    """--moe-router-enable-expert-bias: aux-loss-free balancing bias (sigmoid routing only)."""
    router_bias_update_rate: float = 1e-3
    """--moe-router-bias-update-rate: step of that bias per global batch."""
    token_drop_policy: TokenDropPolicy = "probs"
    """--moe-token-drop-policy (with a capacity factor): drop the lowest-probability tokens
    (probs) or the last ones (position)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise PlanError(f"model.moe.num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.router_topk <= self.num_experts:
            raise PlanError(f"model.moe.router_topk={self.router_topk} must be in "
                            f"[1, num_experts={self.num_experts}]")
        for name in ("ffn_hidden_size", "shared_expert_intermediate_size"):
            if getattr(self, name) < 0:
                raise PlanError(f"model.moe.{name}={getattr(self, name)} must be >= 0")
        for name in ("aux_loss_coeff", "z_loss_coeff", "capacity_factor"):
            if getattr(self, name) < 0:
                raise PlanError(f"model.moe.{name}={getattr(self, name)} must be >= 0")
        if self.router_load_balancing_type not in MOE_BALANCING:
            raise PlanError(f"model.moe.router_load_balancing_type="
                            f"{self.router_load_balancing_type!r} must be one of "
                            f"{', '.join(MOE_BALANCING)}")
        if self.router_score_function not in ("softmax", "sigmoid"):
            raise PlanError(f"model.moe.router_score_function={self.router_score_function!r} "
                            "must be softmax or sigmoid")
        self._check_router()
        freq = self.layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise PlanError(f"model.moe.layer_freq={freq} must be >= 1 or a list of 1/0")
        elif not freq or any(v not in (0, 1) for v in freq):
            raise PlanError(f"model.moe.layer_freq={list(freq)} must be a non-empty list of "
                            "1 (MoE) / 0 (dense), one per layer, or an int")

    def _check_router(self) -> None:
        """The routing rules megatron-core 0.16.1's TransformerConfig.__post_init__ raises on
        (transformer/transformer_config.py:1593-1659), so a plan never fails at model build."""
        for name in ("router_topk_scaling_factor", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise PlanError(f"model.moe.{name}={getattr(self, name)} must be >= 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise PlanError("model.moe.shared_expert_gate=true without "
                            "shared_expert_intermediate_size: there is no shared expert to gate")
        if self.token_drop_policy not in ("probs", "position"):
            raise PlanError(f"model.moe.token_drop_policy={self.token_drop_policy!r} must be "
                            "probs or position")
        if self.router_enable_expert_bias and self.router_score_function != "sigmoid":
            raise PlanError("model.moe.router_enable_expert_bias=true needs "
                            "router_score_function='sigmoid' (--moe-router-score-function "
                            "sigmoid), as megatron-core requires")
        if (self.router_topk == 1 and self.router_score_function == "softmax"
                and not self.router_pre_softmax
                and self.router_load_balancing_type != "sinkhorn"):
            raise PlanError("model.moe.router_topk=1 with softmax routing needs "
                            "router_pre_softmax=true (--moe-router-pre-softmax): a softmax over "
                            "one chosen logit has zero gradient; megatron-core refuses it")
        if self.router_group_topk or self.router_num_groups:
            groups, keep = self.router_num_groups, self.router_group_topk
            if not groups or not keep:
                raise PlanError(f"model.moe.router_num_groups={groups} and router_group_topk="
                                f"{keep}: group-limited routing needs both (>= 1), or neither")
            if groups < 0 or keep < 0 or self.num_experts % groups or keep > groups:
                raise PlanError(f"model.moe.router_num_groups={groups} must divide num_experts="
                                f"{self.num_experts} and router_group_topk={keep} be at most "
                                "router_num_groups")
        if self.aux_loss_coeff and self.router_load_balancing_type == "sinkhorn":
            raise PlanError(f"model.moe.aux_loss_coeff={self.aux_loss_coeff} with "
                            "router_load_balancing_type='sinkhorn': sinkhorn balancing has no "
                            "aux loss (megatron-core asserts a zero coefficient); set it to 0")
        if self.capacity_factor and self.router_load_balancing_type == "sinkhorn":
            raise PlanError("model.moe.capacity_factor with router_load_balancing_type='sinkhorn':"
                            " megatron-core drops tokens only with aux_loss, seq_aux_loss, "
                            "global_aux_loss or none balancing")

    def is_moe_layer(self, layer_idx: int) -> bool:
        freq = self.layer_freq
        return layer_idx % freq == 0 if isinstance(freq, int) else bool(freq[layer_idx])

    def expert_ffn_hidden_size(self, model: ModelSpec) -> int:
        return self.ffn_hidden_size or model.ffn_hidden_size

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not isinstance(self.layer_freq, int):
            data["layer_freq"] = list(self.layer_freq)
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str = "model.moe") -> MoESpec:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        freq = data.get("layer_freq", 1)
        if isinstance(freq, list):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in freq):
                raise PlanError(f"{path}.layer_freq={freq} must hold integers 1/0")
            freq = tuple(freq)
        elif not isinstance(freq, int) or isinstance(freq, bool):
            raise PlanError(f"{path}.layer_freq={freq!r} must be an int or a list of 1/0")
        return cls(
            num_experts=get_int(data, "num_experts", path, minimum=1),
            router_topk=get_int(data, "router_topk", path, default=2, minimum=1),
            ffn_hidden_size=get_int(data, "ffn_hidden_size", path, default=0, minimum=0),
            shared_expert_intermediate_size=get_int(
                data, "shared_expert_intermediate_size", path, default=0, minimum=0),
            layer_freq=freq,
            router_load_balancing_type=get_str(data, "router_load_balancing_type", path,
                                               default="aux_loss", choices=MOE_BALANCING),
            aux_loss_coeff=get_float(data, "aux_loss_coeff", path, default=0.0),
            z_loss_coeff=get_float(data, "z_loss_coeff", path, default=0.0),
            router_score_function=get_str(data, "router_score_function", path,
                                          default="softmax",
                                          choices=("softmax", "sigmoid")),  # type: ignore[arg-type]
            router_pre_softmax=get_bool(data, "router_pre_softmax", path, default=False),
            capacity_factor=get_float(data, "capacity_factor", path, default=0.0),
            shared_expert_gate=get_bool(data, "shared_expert_gate", path, default=False),
            router_topk_scaling_factor=get_float(data, "router_topk_scaling_factor", path,
                                                 default=0.0),
            router_num_groups=get_int(data, "router_num_groups", path, default=0, minimum=0),
            router_group_topk=get_int(data, "router_group_topk", path, default=0, minimum=0),
            router_enable_expert_bias=get_bool(data, "router_enable_expert_bias", path,
                                               default=False),
            router_bias_update_rate=get_float(data, "router_bias_update_rate", path,
                                              default=1e-3),
            token_drop_policy=get_str(data, "token_drop_policy", path, default="probs",
                                      choices=("probs", "position")),  # type: ignore[arg-type]
        )


MOE_BALANCING: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                  "none")


@dataclass(frozen=True, kw_only=True, slots=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3) of a ModelSpec: megatron-core 0.16.1's
    MLASelfAttention (transformer/multi_latent_attention.py) with MLATransformerConfig's fields.

    Defaults are Megatron-LM core_v0.16.1's flag defaults (`_add_mla_args`), not the dataclass's.
    YaRN's beta_fast / beta_slow / original_max_position_embeddings have no Megatron-LM flag, so
    every run uses MLATransformerConfig's 32 / 1 / 4096; they are not plan fields."""

    q_lora_rank: int | None = None
    """--q-lora-rank: rank of the query's low-rank compression; None = no compression (one
    linear_q_proj h -> heads x (qk_head_dim + qk_pos_emb_head_dim))."""
    kv_lora_rank: int = 32
    """--kv-lora-rank: rank of the compressed key/value latent (the KV cache's width)."""
    qk_head_dim: int = 128
    """--qk-head-dim: the per-head query/key width without RoPE."""
    qk_pos_emb_head_dim: int = 64
    """--qk-pos-emb-head-dim: the per-head RoPE part of query/key (the key's is shared by all
    heads)."""
    v_head_dim: int = 128
    """--v-head-dim: the per-head value width."""
    rope_type: RopeType = "yarn"
    """--rope-type (Megatron-LM: None -> MLATransformerConfig's yarn)."""
    rotary_scaling_factor: float = 1.0
    """--rotary-scaling-factor: YaRN's scaling factor (also in the softmax scale's mscale)."""
    mscale: float = 1.0
    """--mscale: YaRN's mscale."""
    mscale_all_dim: float = 0.0
    """--mscale-all-dim: YaRN's mscale_all_dim (the softmax scale is multiplied by its mscale
    squared)."""

    def __post_init__(self) -> None:
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise PlanError(f"model.mla.q_lora_rank={self.q_lora_rank} must be >= 1, or null "
                            "for no query compression")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise PlanError(f"model.mla.{name}={getattr(self, name)} must be >= 1")
        if self.qk_pos_emb_head_dim % 2:
            raise PlanError(f"model.mla.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be "
                            "even (RoPE rotates channel pairs)")
        if self.rope_type not in ("rope", "yarn"):
            raise PlanError(f"model.mla.rope_type={self.rope_type!r} must be rope or yarn")
        if not self.rotary_scaling_factor > 0:
            raise PlanError(f"model.mla.rotary_scaling_factor={self.rotary_scaling_factor} must "
                            "be > 0")
        if not self.mscale > 0 or self.mscale_all_dim < 0:
            raise PlanError(f"model.mla.mscale={self.mscale} must be > 0 and mscale_all_dim="
                            f"{self.mscale_all_dim} >= 0")

    def check_model(self, model: ModelSpec) -> None:
        """What megatron-core / Megatron-LM refuse around MLA, as one-line errors."""
        if model.num_query_groups != model.num_attention_heads:
            # Megatron-LM arguments.py:1265-1266
            raise PlanError(f"model.num_query_groups={model.num_query_groups} with model.mla: "
                            "multi-latent attention has no query groups (Megatron-LM refuses "
                            "--group-query-attention with it); set it to num_attention_heads="
                            f"{model.num_attention_heads}")
        if model.rope_scaling:
            raise PlanError("model.rope_scaling=true with model.mla: MLA's RoPE takes no Llama-3 "
                            "frequency scaling; use model.mla.rope_type='yarn' with "
                            "rotary_scaling_factor")
        if model.add_qkv_bias:
            raise PlanError("model.add_qkv_bias=true with model.mla: megatron-core's MLA "
                            "projections carry no bias; drop --add-qkv-bias")

    def q_head_dim(self) -> int:
        """Per-head query/key width seen by core attention: qk_head_dim + qk_pos_emb_head_dim."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, path: str = "model.mla") -> MLASpec:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        q_rank = data.get("q_lora_rank")
        return cls(
            q_lora_rank=None if q_rank is None else get_int(data, "q_lora_rank", path,
                                                             minimum=1),
            kv_lora_rank=get_int(data, "kv_lora_rank", path, default=32, minimum=1),
            qk_head_dim=get_int(data, "qk_head_dim", path, default=128, minimum=1),
            qk_pos_emb_head_dim=get_int(data, "qk_pos_emb_head_dim", path, default=64,
                                        minimum=1),
            v_head_dim=get_int(data, "v_head_dim", path, default=128, minimum=1),
            rope_type=get_str(data, "rope_type", path, default="yarn",
                              choices=("rope", "yarn")),  # type: ignore[arg-type]
            rotary_scaling_factor=get_float(data, "rotary_scaling_factor", path, default=1.0,
                                            positive=True),
            mscale=get_float(data, "mscale", path, default=1.0, positive=True),
            mscale_all_dim=get_float(data, "mscale_all_dim", path, default=0.0),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One class of links under the alpha-beta model: time = latency_s + bytes / bandwidth."""

    bandwidth_bytes_per_s: float
    """Achievable bus bandwidth per GPU for collectives over this link class."""
    latency_s: float
    """Per-message start-up latency (alpha)."""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or not self.latency_s >= 0:
            raise PlanError(
                f"link bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be > 0 and "
                f"latency_s={self.latency_s} >= 0"
            )

    @classmethod
    def from_dict(cls, data: Any, path: str) -> LinkSpec:
        data = expect_object(data, path)
        reject_unknown(data, {"bandwidth_bytes_per_s", "latency_s"}, path)
        return cls(
            bandwidth_bytes_per_s=get_float(data, "bandwidth_bytes_per_s", path, positive=True),
            latency_s=get_float(data, "latency_s", path, default=0.0),
        )



FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""Megatron-LM core_v0.16.1 --fp8-recipe values megatron_ext plans (`custom` needs a quantizer
factory module and is refused)."""


def _str_tuple(data: dict[str, Any], key: str, path: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanError(f"{path}.{key}={value!r} must be a list of strings")
    return tuple(value)


FP8Format = Literal["e4m3", "hybrid"]
AMAX_ALGOS: tuple[str, ...] = ("most_recent", "max")


@dataclass(frozen=True, kw_only=True, slots=True)
class FP8Spec:
    """FP8 training of the transformer layers' weight GEMMs (QKV, projection, MLP, experts), in
    Megatron-LM core_v0.16.1's terms (the --fp8-* flags, TransformerConfig.fp8*). Embedding,
    output layer, norms and core attention stay in the plan's precision, as in Megatron-LM.

    Which layers run FP8 is the user's choice, never the search's: every layer except the
    first/last window of --first-last-layers-bf16 and the layers listed in `bf16_layers`
    (a per-layer override Megatron-LM cannot express; the layerwise runtime honours it)."""

    format: FP8Format
    """--fp8-format: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients)."""
    recipe: str = "delayed"
    """--fp8-recipe: delayed, tensorwise (current scaling), blockwise (128-element blocks,
    Hopper's DeepSeek-V3 recipe) or mxfp8 (32-element E8M0 blocks; Blackwell only)."""
    margin: int = 0
    """--fp8-margin (delayed recipe: scaling-factor margin, a power of two)."""
    amax_history_len: int = 1
    """--fp8-amax-history-len (delayed recipe)."""
    amax_compute_algo: str = "most_recent"
    """--fp8-amax-compute-algo: most_recent or max (delayed recipe)."""
    wgrad: bool = True
    """FP8 weight-gradient GEMMs; --no-fp8-wgrad makes them bf16 (delayed recipe only)."""
    param_gather: bool = False
    """--fp8-param-gather: FP8 primary weights, all-gathered in FP8 by the distributed
    optimizer (no bf16 copy of the weight GEMMs' parameters)."""
    first_last_layers_bf16: bool = False
    """--first-last-layers-bf16: keep the first and last layers in bf16 (not with delayed)."""
    num_layers_at_start_in_bf16: int = 1
    """--num-layers-at-start-in-bf16 (with first_last_layers_bf16)."""
    num_layers_at_end_in_bf16: int = 1
    """--num-layers-at-end-in-bf16 (with first_last_layers_bf16)."""
    bf16_layers: tuple[int, ...] = ()
    """More layers (global zero-based indices) kept in bf16: megatron_ext's per-layer override,
    run by the layerwise backend (not with delayed: its one block-wide autocast)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bf16_layers", tuple(sorted(set(self.bf16_layers))))
        if self.format not in ("e4m3", "hybrid"):
            raise PlanError(f"fp8.format={self.format!r} must be e4m3 or hybrid (--fp8-format)")
        if self.recipe not in FP8_RECIPES:
            raise PlanError(f"fp8.recipe={self.recipe!r} must be one of {', '.join(FP8_RECIPES)}"
                            " (--fp8-recipe)")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise PlanError(f"fp8.amax_compute_algo={self.amax_compute_algo!r} must be "
                            "most_recent or max (--fp8-amax-compute-algo)")
        for name in ("margin", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise PlanError(f"fp8.{name}={getattr(self, name)} must be >= 0")
        if self.amax_history_len < 1:
            raise PlanError(f"fp8.amax_history_len={self.amax_history_len} must be >= 1 "
                            "(--fp8-amax-history-len)")
        if self.recipe == "delayed" and (self.first_last_layers_bf16 or self.bf16_layers):
            # Megatron-LM: transformer_config.py:990-991; its one outer autocast per block
            # cannot leave single layers out (fp8_utils.py:650-653)
            what = ("first_last_layers_bf16" if self.first_last_layers_bf16
                    else f"bf16_layers={list(self.bf16_layers)}")
            raise PlanError(f"fp8.{what} with fp8.recipe='delayed': delayed scaling runs the "
                            "whole block under one autocast; use --fp8-recipe tensorwise (or "
                            "blockwise / mxfp8) to keep layers in bf16")
        if not self.wgrad and self.recipe != "delayed":
            raise PlanError(f"fp8.wgrad=false (--no-fp8-wgrad) with fp8.recipe={self.recipe!r}:"
                            " Megatron-LM applies it to the delayed recipe only; drop it or use "
                            "--fp8-recipe delayed")

    def bf16_window(self, num_layers: int) -> tuple[int, int]:
        """(start, end) counts of the --first-last-layers-bf16 window (0, 0 when off)."""
        if not self.first_last_layers_bf16:
            return 0, 0
        return self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16

    def layer_in_fp8(self, layer_idx: int, num_layers: int) -> bool:
        """Megatron-LM's is_first_last_bf16_layer (fp8_utils.py:513-530) negated, and not in
        bf16_layers."""
        start, end = self.bf16_window(num_layers)
        if layer_idx < start or layer_idx >= num_layers - end:
            return False
        return layer_idx not in self.bf16_layers

    def fp8_layers(self, num_layers: int) -> tuple[bool, ...]:
        return tuple(self.layer_in_fp8(i, num_layers) for i in range(num_layers))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bf16_layers"] = list(self.bf16_layers)
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str = "fp8") -> FP8Spec:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        layers = data.get("bf16_layers", [])
        if not isinstance(layers, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in layers):
            raise PlanError(f"{path}.bf16_layers={layers!r} must be a list of layer indices")
        return cls(
            format=get_str(data, "format", path, choices=("e4m3", "hybrid")),  # type: ignore[arg-type]
            recipe=get_str(data, "recipe", path, default="delayed", choices=FP8_RECIPES),
            margin=get_int(data, "margin", path, default=0, minimum=0),
            amax_history_len=get_int(data, "amax_history_len", path, default=1, minimum=1),
            amax_compute_algo=get_str(data, "amax_compute_algo", path, default="most_recent",
                                      choices=AMAX_ALGOS),
            wgrad=get_bool(data, "wgrad", path, default=True),
            param_gather=get_bool(data, "param_gather", path, default=False),
            first_last_layers_bf16=get_bool(data, "first_last_layers_bf16", path, default=False),
            num_layers_at_start_in_bf16=get_int(data, "num_layers_at_start_in_bf16", path,
                                                default=1, minimum=0),
            num_layers_at_end_in_bf16=get_int(data, "num_layers_at_end_in_bf16", path,
                                              default=1, minimum=0),
            bf16_layers=tuple(layers),
        )


ALL_TO_ALL_INTER_EFFICIENCY = (0.83, 0.71, 0.68)
"""Default ClusterSpec.all_to_all_inter_efficiency."""

@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A homogeneous GPU cluster: nodes of equal GPUs, an intra-node and an inter-node link
    class."""

    name: str = "custom"
    """Preset name or a label."""
    num_nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """GPUs per node (one host with its NICs, one per GPU: a compute tray of 4 on NVL72)."""
    memory_gib: float = 80.0
    """Usable memory per GPU."""
    peak_flops: float = 989e12
    """Dense bf16 peak per GPU."""
    nvlink_domain_size: int = 0
    """GPUs that share one NVLink fabric (72 on GB200/GB300 NVL72); 0 means gpus_per_node (a
    DGX node is its own domain). Groups inside it run at `intra_node` speed, so tensor, expert
    and context groups may span it; a multiple of gpus_per_node that divides the job's GPUs
    (or holds all of them)."""
    peak_fp8_flops: float = 0.0
    """Dense FP8 tensor-core peak per GPU; 0: the GPU has no FP8 GEMMs (A100)."""
    fp8_recipes: tuple[str, ...] = ()
    """FP8 scaling recipes the GPU runs (Megatron-LM --fp8-recipe values): delayed, tensorwise
    and blockwise from Hopper on, mxfp8 (block-scaled E8M0 scales) on Blackwell only."""
    intra_node: LinkSpec = field(
        default_factory=lambda: LinkSpec(bandwidth_bytes_per_s=360e9, latency_s=5e-6)
    )
    """NVLink/NVSwitch inside an NVLink domain (a node, or a whole NVL72 rack)."""
    inter_node: LinkSpec = field(
        default_factory=lambda: LinkSpec(bandwidth_bytes_per_s=45e9, latency_s=1e-5)
    )
    """Network between NVLink domains, bandwidth per GPU (one NIC per GPU, rails as on DGX)."""
    all_to_all_inter_efficiency: tuple[float, ...] = ALL_TO_ALL_INTER_EFFICIENCY
    """Share of inter_node bandwidth an all-to-all spanning 2, 4, 8 (the last value: and more)
    nodes achieves. Default: FlexSP's measured all-to-all on 8 x 8 A100, 400 Gb/s IB per node
    (planner/flexsp/cost.py derives it). Only the FlexSP cost model reads it."""

    def __post_init__(self) -> None:
        eff = self.all_to_all_inter_efficiency
        if not eff or not all(0 < e <= 1 for e in eff):
            raise PlanError(f"cluster all_to_all_inter_efficiency={list(eff)} must be a non-empty "
                            "list of shares in (0, 1]; e.g. [0.83, 0.71, 0.68]")
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise PlanError(
                f"cluster num_nodes={self.num_nodes} and gpus_per_node={self.gpus_per_node} "
                "must be >= 1"
            )
        if not self.memory_gib > 0 or not self.peak_flops > 0:
            raise PlanError(
                f"cluster memory_gib={self.memory_gib} and peak_flops={self.peak_flops} must be > 0"
            )
        self._check_nvlink_and_fp8()

    def _check_nvlink_and_fp8(self) -> None:
        domain, gpn, gpus = self.nvlink_domain_size, self.gpus_per_node, self.num_gpus
        if domain < 0 or (domain and domain % gpn):
            raise PlanError(f"cluster nvlink_domain_size={domain} must be a multiple of "
                            f"gpus_per_node={gpn} (whole nodes share one NVLink fabric); "
                            "0 means one node")
        if domain and gpus > domain and gpus % domain:
            raise PlanError(f"cluster nvlink_domain_size={domain} does not divide the job's "
                            f"{gpus} GPUs ({self.num_nodes} nodes x {gpn}); use whole NVLink "
                            "domains (--nodes), or set it to the GPUs the job uses per domain")
        if self.peak_fp8_flops < 0 or (self.fp8_recipes and not self.peak_fp8_flops):
            raise PlanError(f"cluster peak_fp8_flops={self.peak_fp8_flops} must be > 0 when "
                            f"fp8_recipes={list(self.fp8_recipes)} are given (0: no FP8)")
        bad = [r for r in self.fp8_recipes if r not in FP8_RECIPES]
        if bad:
            raise PlanError(f"cluster fp8_recipes has {bad[0]!r}; use any of "
                            f"{', '.join(FP8_RECIPES)}")

    @property
    def nvlink_domain(self) -> int:
        """GPUs of one NVLink domain (nvlink_domain_size, or gpus_per_node when that is 0)."""
        return self.nvlink_domain_size or self.gpus_per_node

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)  # JSON types: from_dict reads a list, not a tuple
        data["all_to_all_inter_efficiency"] = list(self.all_to_all_inter_efficiency)
        data["fp8_recipes"] = list(self.fp8_recipes)
        for name in ("nvlink_domain_size", "peak_fp8_flops", "fp8_recipes"):
            if not data[name]:  # defaults stay out: older files and readers are unchanged
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str = "cluster") -> ClusterSpec:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        if "intra_node" not in data or "inter_node" not in data:
            raise PlanError(f"{path} needs both intra_node and inter_node link objects")
        return cls(
            name=get_str(data, "name", path, default="custom"),
            num_nodes=get_int(data, "num_nodes", path, minimum=1),
            gpus_per_node=get_int(data, "gpus_per_node", path, minimum=1),
            memory_gib=get_float(data, "memory_gib", path, positive=True),
            peak_flops=get_float(data, "peak_flops", path, positive=True),
            nvlink_domain_size=get_int(data, "nvlink_domain_size", path, default=0, minimum=0),
            peak_fp8_flops=get_float(data, "peak_fp8_flops", path, default=0.0),
            fp8_recipes=_str_tuple(data, "fp8_recipes", path),
            intra_node=LinkSpec.from_dict(data["intra_node"], f"{path}.intra_node"),
            inter_node=LinkSpec.from_dict(data["inter_node"], f"{path}.inter_node"),
            all_to_all_inter_efficiency=get_float_list(data, "all_to_all_inter_efficiency", path)
            or ALL_TO_ALL_INTER_EFFICIENCY,
        )
