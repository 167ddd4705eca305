"""Built-in model and cluster presets, and the model-file reader (HuggingFace `config.json`
files through the hf_config package).

Model shapes are the published configurations. Cluster link bandwidths are achievable bus
bandwidths per GPU (NCCL all-reduce busbw), not the marketing bidirectional figure:
A100 NVLink3 600 GB/s bidirectional -> ~230 GB/s busbw; H100/H200 NVLink4 900 GB/s -> ~360 GB/s;
inter-node one HDR 200 Gb/s NIC per GPU -> ~22 GB/s, one NDR 400 Gb/s NIC per GPU -> ~45 GB/s.
The dgx-a100 constants are checked against 55 published A100 runs (tools/bench_published.py,
docs/benchmarks.md): TP over NVLink and DP over one NIC per GPU by the PTD-P runs of SC'21
Tables 1-2 (within 1-5%), 22 GB/s per GPU by SC'21 Table 2's ZeRO-3 runs (21-23 GB/s measured).

Hopper and Blackwell presets (dense peaks, no sparsity; `nvlink_domain_size` = GPUs on one NVLink
fabric, `gpus_per_node` = GPUs per host with one NIC each):
- dgx-h100 / dgx-h200: 989 TFLOPS bf16, 1,979 FP8 (NVIDIA H100 data sheet, halved from its
  with-sparsity figures; H200 = H100 compute), 80 GB / 141 GB HBM, NVLink 4 900 GB/s, one
  ConnectX-7 400 Gb/s NIC per GPU (MLPerf Training v5.0 system eos-dfw_n64_ngc25.01_nemo.json).
- dgx-b200: 2,250 TFLOPS bf16, 4,500 FP8 (HGX/DGX B200 at 1,000 W, NVIDIA B200 data sheet via
  glennklockwood.com/garden/processors/B200), 180 GB HBM3e, NVLink 5 1,800 GB/s, one CX-7
  400 Gb/s per GPU (MLPerf v5.0 system nyx_n1_ngc25.04_nemo.json: B200-SXM-180GB).
- gb200-nvl72: 2,500 TFLOPS bf16, 5,000 FP8 per GPU (GB200 NVL72 data sheet: 180 PF bf16 /
  360 PF FP8 dense per 72-GPU rack; 1,200 W parts), 186 GB HBM3e, 72 GPUs on one NVLink 5
  fabric (130 TB/s per rack = 1.8 TB/s per GPU), compute trays of 4 GPUs with one CX-7 400 Gb/s
  each (MLPerf v5.0 system tyche_ngpu512_ngc25.04_nemo.json: "GB200 NVL72", 4 per node, 4x CX-7).
- gb300-nvl72: the same bf16 / FP8 peaks (GB300 NVL72 data sheet: 180 PF bf16, 360 PF FP8 per
  rack; verda.com/blog/gb300-nvl72-architecture), 284,208 MiB = 277.5 GiB HBM3e per GPU and one
  CX-8 800 Gb/s NIC per GPU (MLPerf Training v5.1 system theia_ngpu512_ngc25.09_nemo.json).
NVLink 5 doubles NVLink 4's raw bandwidth: until measured, its busbw is 2 x H100's 360 GB/s =
720 GB/s; an 800 Gb/s NIC doubles the 45 GB/s of a 400 Gb/s one. Megatron-LM's --fp8-recipe
mxfp8 needs Blackwell (transformer_config.py:441 at core_v0.16.1), so only the Blackwell presets
list it.
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


HOPPER_FP8 = ("delayed", "tensorwise", "blockwise")
BLACKWELL_FP8 = HOPPER_FP8 + ("mxfp8",)


def _dgx(name: str, memory_gib: float, flops: float, nvlink: float, net: float, *,
         fp8_flops: float = 0.0, fp8: tuple[str, ...] = (), gpus_per_node: int = 8,
         nvlink_domain: int = 0) -> ClusterSpec:
    return ClusterSpec(
        name=name, num_nodes=1, gpus_per_node=gpus_per_node, memory_gib=memory_gib,
        peak_flops=flops, nvlink_domain_size=nvlink_domain, peak_fp8_flops=fp8_flops,
        fp8_recipes=fp8,
        intra_node=LinkSpec(bandwidth_bytes_per_s=nvlink, latency_s=3.4e-6),
        inter_node=LinkSpec(bandwidth_bytes_per_s=net, latency_s=9.6e-6),
    )


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        _dgx("dgx-a100-40g", 40.0, 312e12, 230e9, 22e9),
        _dgx("dgx-a100-80g", 80.0, 312e12, 230e9, 22e9),
        _dgx("dgx-h100", 80.0, 989e12, 360e9, 45e9, fp8_flops=1979e12, fp8=HOPPER_FP8),
        _dgx("dgx-h200", 140.0, 989e12, 360e9, 45e9, fp8_flops=1979e12, fp8=HOPPER_FP8),
        _dgx("dgx-b200", 180.0, 2250e12, 720e9, 45e9, fp8_flops=4500e12, fp8=BLACKWELL_FP8),
        # NVL72: 4-GPU compute trays (a "node" = one host and its NICs), 72 GPUs per NVLink
        # fabric. A job of whole trays inside one rack, or of whole racks (--nodes 18 k).
        _dgx("gb200-nvl72", 186.0, 2500e12, 720e9, 45e9, fp8_flops=5000e12, fp8=BLACKWELL_FP8,
             gpus_per_node=4, nvlink_domain=72),
        _dgx("gb300-nvl72", 277.5, 2500e12, 720e9, 90e9, fp8_flops=5000e12, fp8=BLACKWELL_FP8,
             gpus_per_node=4, nvlink_domain=72),
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
