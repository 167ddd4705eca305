"""Megatron-LM flag names as data: the emission table and the flags megatron_ext refuses.

`EMIT_TABLE` lists, in print order and grouped by concern as Megatron's example scripts group
them, every flag `megatron-ext args` can print, with its argparse `dest` (the attribute of
Megatron-LM's args namespace) and how a value becomes argv tokens. The parser in arguments.py
defines the same flags with the same dests, so printing and parsing round-trip.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["value", "true", "false", "list", "freq"]
"""value: `--flag V`; true: `--flag` when True (store_true); false: `--flag` when False
(store_false, e.g. --disable-bias-linear for add_bias_linear=False); list: `--flag V1 V2 ...`;
freq: --moe-layer-freq's int or list pattern (`([0]*3+[1]*58)`)."""

EMIT_TABLE: tuple[tuple[str, str, str, Kind], ...] = (
    # (concern, dest, flag, kind)
    ("model", "num_layers", "--num-layers", "value"),
    ("model", "hidden_size", "--hidden-size", "value"),
    ("model", "ffn_hidden_size", "--ffn-hidden-size", "value"),
    ("model", "num_attention_heads", "--num-attention-heads", "value"),
    ("model", "group_query_attention", "--group-query-attention", "true"),
    ("model", "num_query_groups", "--num-query-groups", "value"),
    ("model", "kv_channels", "--kv-channels", "value"),
    ("model", "max_position_embeddings", "--max-position-embeddings", "value"),
    ("model", "position_embedding_type", "--position-embedding-type", "value"),
    ("model", "normalization", "--normalization", "value"),
    ("model", "swiglu", "--swiglu", "true"),
    ("model", "untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights",
     "true"),
    ("model", "add_bias_linear", "--disable-bias-linear", "false"),
    ("model", "add_qkv_bias", "--add-qkv-bias", "true"),
    ("model", "qk_layernorm", "--qk-layernorm", "true"),
    ("model", "layernorm_epsilon", "--norm-epsilon", "value"),
    ("model", "rotary_base", "--rotary-base", "value"),
    ("model", "rotary_percent", "--rotary-percent", "value"),
    ("model", "use_rope_scaling", "--use-rope-scaling", "true"),
    ("model", "rope_scaling_factor", "--rope-scaling-factor", "value"),
    ("model", "vocab_size", "--vocab-size", "value"),
    ("moe", "num_experts", "--num-experts", "value"),
    ("moe", "moe_ffn_hidden_size", "--moe-ffn-hidden-size", "value"),
    ("moe", "moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size",
     "value"),
    ("moe", "moe_shared_expert_gate", "--moe-shared-expert-gate", "true"),
    ("moe", "moe_layer_freq", "--moe-layer-freq", "freq"),
    ("moe", "moe_router_topk", "--moe-router-topk", "value"),
    ("moe", "moe_router_score_function", "--moe-router-score-function", "value"),
    ("moe", "moe_router_pre_softmax", "--moe-router-pre-softmax", "true"),
    ("moe", "moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", "value"),
    ("moe", "moe_router_num_groups", "--moe-router-num-groups", "value"),
    ("moe", "moe_router_group_topk", "--moe-router-group-topk", "value"),
    ("moe", "moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", "true"),
    ("moe", "moe_router_bias_update_rate", "--moe-router-bias-update-rate", "value"),
    ("moe", "moe_router_load_balancing_type", "--moe-router-load-balancing-type", "value"),
    ("moe", "moe_aux_loss_coeff", "--moe-aux-loss-coeff", "value"),
    ("moe", "moe_z_loss_coeff", "--moe-z-loss-coeff", "value"),
    ("moe", "moe_expert_capacity_factor", "--moe-expert-capacity-factor", "value"),
    ("moe", "moe_token_drop_policy", "--moe-token-drop-policy", "value"),
    ("mla", "multi_latent_attention", "--multi-latent-attention", "true"),
    ("mla", "q_lora_rank", "--q-lora-rank", "value"),
    ("mla", "kv_lora_rank", "--kv-lora-rank", "value"),
    ("mla", "qk_head_dim", "--qk-head-dim", "value"),
    ("mla", "qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", "value"),
    ("mla", "v_head_dim", "--v-head-dim", "value"),
    ("mla", "rope_type", "--rope-type", "value"),
    ("mla", "apply_rope_fusion", "--no-rope-fusion", "false"),
    ("mla", "rotary_scaling_factor", "--rotary-scaling-factor", "value"),
    ("mla", "mscale", "--mscale", "value"),
    ("mla", "mscale_all_dim", "--mscale-all-dim", "value"),
    ("parallel", "tensor_model_parallel_size", "--tensor-model-parallel-size", "value"),
    ("parallel", "pipeline_model_parallel_size", "--pipeline-model-parallel-size", "value"),
    ("parallel", "decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers",
     "value"),
    ("parallel", "decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers",
     "value"),
    ("parallel", "pipeline_model_parallel_layout", "--pipeline-model-parallel-layout", "value"),
    ("parallel", "num_layers_per_virtual_pipeline_stage",
     "--num-layers-per-virtual-pipeline-stage", "value"),
    ("parallel", "expert_model_parallel_size", "--expert-model-parallel-size", "value"),
    ("parallel", "expert_tensor_parallel_size", "--expert-tensor-parallel-size", "value"),
    ("parallel", "context_parallel_size", "--context-parallel-size", "value"),
    ("parallel", "cp_comm_type", "--cp-comm-type", "list"),
    ("parallel", "hierarchical_context_parallel_sizes", "--hierarchical-context-parallel-sizes",
     "list"),
    ("parallel", "sequence_parallel", "--sequence-parallel", "true"),
    ("parallel", "use_distributed_optimizer", "--use-distributed-optimizer", "true"),
    ("parallel", "use_torch_fsdp2", "--use-torch-fsdp2", "true"),
    ("parallel", "gradient_accumulation_fusion", "--no-gradient-accumulation-fusion", "false"),
    # how the run overlaps its data-parallel traffic: run settings the plan records, not layout
    ("ddp", "overlap_grad_reduce", "--overlap-grad-reduce", "true"),
    ("ddp", "overlap_param_gather", "--overlap-param-gather", "true"),
    # Transformer Engine's overlap of the TP collectives: a run setting too (planner only)
    ("ddp", "tp_comm_overlap", "--tp-comm-overlap", "true"),
    ("parallel", "recompute_granularity", "--recompute-granularity", "value"),
    ("parallel", "recompute_method", "--recompute-method", "value"),
    ("parallel", "recompute_num_layers", "--recompute-num-layers", "value"),
    ("batch", "micro_batch_size", "--micro-batch-size", "value"),
    ("batch", "global_batch_size", "--global-batch-size", "value"),
    ("batch", "seq_length", "--seq-length", "value"),
    ("precision", "bf16", "--bf16", "true"),
    ("precision", "fp16", "--fp16", "true"),
    ("precision", "fp8", "--fp8-format", "value"),
    ("precision", "fp8_recipe", "--fp8-recipe", "value"),
    ("precision", "fp8_margin", "--fp8-margin", "value"),
    ("precision", "fp8_amax_history_len", "--fp8-amax-history-len", "value"),
    ("precision", "fp8_amax_compute_algo", "--fp8-amax-compute-algo", "value"),
    ("precision", "fp8_wgrad", "--no-fp8-wgrad", "false"),
    ("precision", "fp8_param_gather", "--fp8-param-gather", "true"),
    ("precision", "first_last_layers_bf16", "--first-last-layers-bf16", "true"),
    ("precision", "num_layers_at_start_in_bf16", "--num-layers-at-start-in-bf16", "value"),
    ("precision", "num_layers_at_end_in_bf16", "--num-layers-at-end-in-bf16", "value"),
    ("megatron_ext", "vocab_parallel", "--vocab-parallel", "true"),
    ("megatron_ext", "vocab_parallel_algorithm", "--vocab-parallel-algorithm", "value"),
    ("megatron_ext", "flexsp", "--flexsp", "true"),
    ("megatron_ext", "flexsp_max_group_size", "--flexsp-max-group-size", "value"),
    ("megatron_ext", "flexsp_min_group_size", "--flexsp-min-group-size", "value"),
    # FlexSP's packed attention has no dropout: printed (0) only for FlexSP plans
    ("megatron_ext", "attention_dropout", "--attention-dropout", "value"),
    ("megatron_ext", "strategy_config", "--strategy-config", "value"),
)

FLAG_OF_DEST: dict[str, str] = {dest: flag for _, dest, flag, _ in EMIT_TABLE}

OUR_DESTS = frozenset(dest for concern, dest, _, _ in EMIT_TABLE if concern == "megatron_ext")
"""Flags that only megatron_ext's pretrain_gpt.py understands."""
