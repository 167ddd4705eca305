"""The search benchmark's fixed suite of cases (`tools/bench_search.py`), as data: the dense and
MoE models, clusters, batches and memory limits the search is timed and scored on. Tests read it
too, so a change of the suite changes what both check."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MOE_SUITE", "SUITE", "Case"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One benchmark case."""

    model: str
    """Model preset."""
    cluster: str
    """Cluster preset."""
    nodes: int
    """Nodes of 8 GPUs."""
    global_batch_size: int
    """Samples per step."""
    seq_length: int
    """Tokens per sample."""
    memory_gib: float | None = None
    """Override of the preset's memory per GPU."""
    tight: bool = False
    """Counts towards min_speedup_memory_tight."""
    target_s: float | None = None
    """Search-time target of the issue."""

    @property
    def key(self) -> str:
        gpus = self.nodes * 8
        return f"{self.model}@{gpus}" + (f"@{self.memory_gib:g}GiB" if self.memory_gib else "")


SUITE = (
    Case(model="llama2-7b", cluster="dgx-h100", nodes=1, global_batch_size=512,
         seq_length=4096, target_s=1.0),
    Case(model="llama2-13b", cluster="dgx-a100-40g", nodes=2, global_batch_size=512,
         seq_length=4096, tight=True),
    Case(model="llama3-70b", cluster="dgx-h100", nodes=8, global_batch_size=1024,
         seq_length=8192, target_s=10.0),
    Case(model="gpt3-175b", cluster="dgx-a100-80g", nodes=128,
         global_batch_size=1536, seq_length=2048),
    Case(model="llama3-405b", cluster="dgx-h100", nodes=512,
         global_batch_size=2048, seq_length=8192),
    Case(model="llama3-405b", cluster="dgx-h100", nodes=1024, global_batch_size=2048,
         seq_length=8192, target_s=10.0),
    # memory-tight variants
    Case(model="llama2-7b", cluster="dgx-h100", nodes=1, global_batch_size=512,
         seq_length=4096, memory_gib=24, tight=True),
    Case(model="llama3-8b", cluster="dgx-h100", nodes=1, global_batch_size=512,
         seq_length=8192, memory_gib=24, tight=True),
    Case(model="llama3-70b", cluster="dgx-h100", nodes=8, global_batch_size=1024,
         seq_length=8192, memory_gib=40, tight=True),
    Case(model="gpt3-175b", cluster="dgx-a100-40g", nodes=128, global_batch_size=1536,
         seq_length=2048, memory_gib=40, tight=True),
)


MOE_SUITE = (
    # Mixtral-8x7B on 64 H100 (NeMo's performance-table setting: GBS 256, seq 4096)
    Case(model="mixtral-8x7b", cluster="dgx-h100", nodes=8, global_batch_size=256,
         seq_length=4096),
    # Qwen2-57B-A14B (64 experts top-8 + a 20480-wide gated shared expert) on 128 H100
    Case(model="qwen2-57b-a14b", cluster="dgx-h100", nodes=16, global_batch_size=512,
         seq_length=4096),
    # DeepSeekMoE-16B (first layer dense, 64 fine-grained experts top-6, 2 shared) on 128 H100
    Case(model="deepseek-moe-16b", cluster="dgx-h100", nodes=16, global_batch_size=1024,
         seq_length=4096),
    # memory-tight: Mixtral-8x7B on 64 GPUs of 40 GiB
    Case(model="mixtral-8x7b", cluster="dgx-h100", nodes=8, global_batch_size=256,
         seq_length=4096, memory_gib=40, tight=True),
)
