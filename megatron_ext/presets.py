"""Built-in model and cluster presets, and the model-file reader (HuggingFace `config.json`
files through the hf_config package).

Model shapes are the published configurations. Cluster link bandwidths are achievable bus
bandwidths per GPU (NCCL all-reduce busbw), not the marketing bidirectional figure:
A100 NVLink3 600 GB/s bidirectional -> ~230 GB/s busbw; H100/H200 NVLink4 900 GB/s -> ~360 GB/s;
inter-node one HDR 200 Gb/s NIC per GPU -> ~22 GB/s, one NDR 400 Gb/s NIC per GPU -> ~45 GB/s.
The dgx-a100 constants are checked against 55 published A100 runs (tools/bench_published.py,
docs/benchmarks.md): TP over NVLink and DP over one NIC per GPU by the PTD-P runs of SC'21
Tables 1-2 (within 1-5%), 22 GB/s per GPU by SC'21 Table 2's ZeRO-3 runs (21-23 GB/s measured).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from pathlib import Path

from megatron_ext.errors import PlanError
from megatron_ext.hf_config import model_from_hf_config
from megatron_ext.schema import load_json_file
from megatron_ext.specs import ClusterSpec, LinkSpec, ModelSpec, MoESpec


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
        num_attention_heads=heads, num_query_groups=heads, vocab_size=50257,
        tied_embeddings=True, activation="gelu", normalization="LayerNorm",
        position_embedding="learned_absolute", max_position_embeddings=2048, add_bias_linear=True,
    )


def _llama(
    name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, ctx: int
) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=kv, vocab_size=vocab, tied_embeddings=False,
        activation="swiglu", normalization="RMSNorm", position_embedding="rope",
        max_position_embeddings=ctx,
    )


def _qwen_moe(base: ModelSpec, *, experts: int, topk: int, expert_ffn: int,
              shared_ffn: int) -> ModelSpec:
    """A Qwen-MoE (Qwen1.5-MoE, Qwen2-MoE) on `base`: q/k/v biases, RoPE base 1e6, RMSNorm eps
    1e-6, a gated shared expert, aux-loss 0.001, pre-softmax routing (norm_topk_prob=false)."""
    return dataclasses.replace(
        base, add_qkv_bias=True, rotary_base=1000000, norm_epsilon=1e-6,
        moe=MoESpec(num_experts=experts, router_topk=topk, ffn_hidden_size=expert_ffn,
                    shared_expert_intermediate_size=shared_ffn, shared_expert_gate=True,
                    aux_loss_coeff=0.001, router_pre_softmax=True))


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        dataclasses.replace(_llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
                            rotary_base=500000),
        dataclasses.replace(_llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
                            rotary_base=500000),
        # Llama 3.1 405B: RoPE base 500000 with Llama 3 scaling (factor 8)
        dataclasses.replace(_llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
                            rotary_base=500000, rope_scaling=True),
        # Qwen2.5-7B: q/k/v biases, RoPE base 1e6, RMSNorm eps 1e-6 (its config.json)
        dataclasses.replace(_llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768),
                            add_qkv_bias=True, rotary_base=1000000, norm_epsilon=1e-6),
        # Mixture of Experts (their HuggingFace config.json files; MoE fields as
        # hf_config maps them: Qwen/DeepSeek norm_topk_prob=false -> pre-softmax routing).
        # Mixtral-8x7B: every layer MoE, 8 experts top-2, expert width = intermediate_size.
        dataclasses.replace(
            _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768), rotary_base=1000000,
            moe=MoESpec(num_experts=8, router_topk=2, aux_loss_coeff=0.02)),
        # Qwen1.5-MoE-A2.7B: 60 experts top-4 (width 1408) + a 5632-wide gated shared expert.
        _qwen_moe(_llama("qwen1.5-moe-a2.7b", 24, 2048, 16, 16, 5632, 151936, 8192),
                  experts=60, topk=4, expert_ffn=1408, shared_ffn=5632),
        # Qwen2-57B-A14B: 64 experts top-8 (width 2560) + a 20480-wide shared expert, GQA 28/4.
        _qwen_moe(_llama("qwen2-57b-a14b", 28, 3584, 28, 4, 18944, 151936, 32768),
                  experts=64, topk=8, expert_ffn=2560, shared_ffn=20480),
        # DeepSeekMoE-16B: first layer dense (width 10944), then 64 fine-grained experts top-6
        # (width 1408) + 2 shared experts (2 x 1408); multi-head attention (no MLA).
        dataclasses.replace(
            _llama("deepseek-moe-16b", 28, 2048, 16, 16, 10944, 102400, 4096),
            norm_epsilon=1e-6,
            moe=MoESpec(num_experts=64, router_topk=6, ffn_hidden_size=1408,
                        shared_expert_intermediate_size=2816, aux_loss_coeff=0.001,
                        router_pre_softmax=True, layer_freq=(0,) + (1,) * 27)),
        # Small enough to train on CPU under gloo: tests, examples and the CPU walk-through.
        _llama("tiny-llama", 4, 64, 4, 2, 176, 512, 256),
        dataclasses.replace(_gpt3("tiny-gpt", 4, 64, 4), vocab_size=512,
                            max_position_embeddings=256),
        # Dense and MoE layers alternate (layer_freq 0,1,0,1): 4 experts top-2, no biases.
        dataclasses.replace(_llama("tiny-moe", 4, 64, 4, 4, 128, 512, 256),
                            moe=MoESpec(num_experts=4, router_topk=2, layer_freq=(0, 1, 0, 1),
                                        aux_loss_coeff=0.01)),
    )
}


def _dgx(name: str, memory_gib: float, flops: float, nvlink: float, net: float) -> ClusterSpec:
    return ClusterSpec(
        name=name, num_nodes=1, gpus_per_node=8, memory_gib=memory_gib, peak_flops=flops,
        intra_node=LinkSpec(bandwidth_bytes_per_s=nvlink, latency_s=3.4e-6),
        inter_node=LinkSpec(bandwidth_bytes_per_s=net, latency_s=9.6e-6),
    )


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        _dgx("dgx-a100-40g", 40.0, 312e12, 230e9, 22e9),
        _dgx("dgx-a100-80g", 80.0, 312e12, 230e9, 22e9),
        _dgx("dgx-h100", 80.0, 989e12, 360e9, 45e9),
        _dgx("dgx-h200", 140.0, 989e12, 360e9, 45e9),
    )
}


def _did_you_mean(name: str, known: list[str]) -> str:
    """"did you mean 'llama2-7b'? " for llama2_7b, or "" when nothing is close."""
    close = difflib.get_close_matches(name.lower().replace("_", "-"), known, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def model_preset(name: str) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise PlanError(
            f"--model={name!r} is not a preset; {_did_you_mean(name, list(MODEL_PRESETS))}"
            f"use one of {', '.join(MODEL_PRESETS)} or --model-config FILE"
        )
    return MODEL_PRESETS[name]


def cluster_preset(name: str, *, num_nodes: int = 1,
                   memory_gib: float | None = None) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise PlanError(
            f"--cluster={name!r} is not a preset; {_did_you_mean(name, list(CLUSTER_PRESETS))}"
            f"use one of {', '.join(CLUSTER_PRESETS)} or --cluster-profile FILE"
        )
    if num_nodes < 1:
        raise PlanError(f"--nodes={num_nodes} must be >= 1")
    cluster = dataclasses.replace(CLUSTER_PRESETS[name], num_nodes=num_nodes)
    if memory_gib is not None:
        if not memory_gib > 0:
            raise PlanError(f"--memory-gib={memory_gib} must be > 0")
        cluster = dataclasses.replace(cluster, memory_gib=memory_gib)
    return cluster


def model_from_file(path: str | Path) -> ModelSpec:
    """A ModelSpec JSON (our field names) or a HuggingFace `config.json` (the hf_config package)."""
    return model_file_with_notes(path)[0]


def model_file_with_notes(path: str | Path) -> tuple[ModelSpec, tuple[str, ...]]:
    """model_from_file, plus the HuggingFace fields read without shaping the model (why)."""
    data = load_json_file(path, "model config")
    if set(data) & {"num_hidden_layers", "n_layer", "model_type", "architectures"}:
        path = Path(path)  # .../Llama-2-7b-hf/config.json is labelled Llama-2-7b-hf
        label = path.parent.name if path.stem == "config" and path.parent.name else path.stem
        hf = model_from_hf_config(data, label)
        defaults = hf.defaults_line(label)
        if defaults:  # absent fields took the config class's defaults: say which
            sys.stderr.write(defaults + "\n")
        return hf.spec, hf.notes
    return ModelSpec.from_dict(data, path="model"), ()
