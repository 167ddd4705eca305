"""A `TransformerBlock` whose layers each run their own strategy, joined by re-layouts.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden; local blocks `[s_loc, b_loc, h]`
per `geometry/activation.py` (e.g. `[s/tp, b/dp, h]` under SP).

Subclasses megatron-core's `TransformerBlock` only where a hook is missing (docs/design.md,
Runtime):
`_build_layers` builds each stock `TransformerLayer` with its own config and
`ProcessGroupCollection`; `forward` inserts `redistribute` between runs of equal layouts, gives
each layout its own rotary table (positions of its sequence chunks) and applies full recompute
per layer; `sharded_state_dict` keeps global keys `layers.{layer_idx}` with each layer's own TP
sharding and replica ids (`dp_cp_group` of its layout). Layers sit in a `GlobalLayerList` keyed by
the
global layer index, so plain state dicts carry global keys too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import make_viewless_tensor

from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.megatron_adapter.fsdp import layer_sharded_state_dict
from megatron_ext.runtime.groups import PlanGroups
from megatron_ext.runtime.redistribute import redistribute

__all__ = ["GlobalLayerList", "HeteroTransformerBlock", "LayerBuild"]


class GlobalLayerList(torch.nn.ModuleDict):
    """`ModuleList` behaviour (iteration over layers, positional int indexing, as megatron-core
    code such as `set_current_microbatch` expects) with global layer indices as keys."""

    def __iter__(self) -> Iterator[torch.nn.Module]:  # type: ignore[override]
        return iter(self._modules.values())

    def __getitem__(self, key: int | str) -> torch.nn.Module:  # type: ignore[override]
        if isinstance(key, int):
            return list(self._modules.values())[key]
        return self._modules[key]


@dataclass(frozen=True, kw_only=True)
class LayerBuild:
    """Everything needed to build and run one layer."""

    layer_idx: int
    """Global zero-based layer index."""
    layout: ActivationLayout
    config: TransformerConfig
    spec: ModuleSpec
    pg_collection: ProcessGroupCollection
    full_recompute: bool


class HeteroTransformerBlock(TransformerBlock):
    """The decoder layers of one pipeline stage, each with its own layout."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        builds: list[LayerBuild],
        groups: PlanGroups,
        input_layout: ActivationLayout,
        output_layout: ActivationLayout,
        final_norm: Any | None,
        pg_collection: ProcessGroupCollection,
        pre_process: bool,
        post_process: bool,
    ) -> None:
        # Read by _build_layers, which TransformerBlock.__init__ calls.
        self._builds = builds
        self._groups = groups
        self.input_layout = input_layout
        """Layout of the stage input (embedding output or previous stage's boundary)."""
        self.output_layout = output_layout
        """Layout of the stage output (loss layout on the last stage, else the boundary)."""
        spec = TransformerBlockSubmodules(layer_specs=[], layer_norm=final_norm)
        super().__init__(config=config, spec=spec, post_layer_norm=final_norm is not None,
                         pre_process=pre_process, post_process=post_process,
                         pg_collection=pg_collection)
        self._rope_index: dict[tuple[ActivationLayout, int], torch.Tensor] = {}

    def _build_layers(self) -> None:
        self.layers = GlobalLayerList({
            str(b.layer_idx): build_module(b.spec, config=b.config, layer_number=b.layer_idx + 1,
                                           pg_collection=b.pg_collection)
            for b in self._builds
        })
        self.final_layernorm = None
        if self.post_process and self.submodules.layer_norm is not None:
            self.final_layernorm = build_module(
                self.submodules.layer_norm, config=self.config,
                hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon,
            )

    @property
    def builds(self) -> list[LayerBuild]:
        return self._builds

    def global_seq_length(self, hidden_states: torch.Tensor) -> int:
        """Full sequence length of a stage input in `input_layout`."""
        layout = self.input_layout
        return hidden_states.shape[0] * layout.cp * layout.ulysses * (layout.tp if layout.sp else 1)

    def _local_rope(self, rope: torch.Tensor | None,
                    layout: ActivationLayout) -> torch.Tensor | None:
        """Rows of the full `[s, 1, 1, d]` rotary table for the positions attention sees."""
        if rope is None:
            return None
        key = (layout, rope.shape[0])
        if key not in self._rope_index:
            positions = layout.attention_layout().positions(self._groups.local_rank, rope.shape[0])
            self._rope_index[key] = torch.tensor(positions, device=rope.device)
        return rope.index_select(0, self._rope_index[key])  # [s_attn, 1, 1, d]

    def _run_layer(self, build: LayerBuild, hidden: torch.Tensor, mask: Any,
                   rope: torch.Tensor | None) -> torch.Tensor:
        layer = self.layers[str(build.layer_idx)]

        def run(x: torch.Tensor, attention_mask: Any, rotary: Any) -> torch.Tensor:
            out, _ = layer(hidden_states=x, attention_mask=attention_mask, rotary_pos_emb=rotary)
            return out

        fork = build.config.sequence_parallel and build.config.hidden_dropout > 0
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else nullcontext():
            if build.full_recompute and self.training:
                return tensor_parallel.checkpoint(run, False, hidden, mask, rope)
            return run(hidden, mask, rope)

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: Any = None,
                rotary_pos_emb: torch.Tensor | None = None, **_unused: Any) -> torch.Tensor:
        """`[s_loc, b_loc, h]` in `input_layout` -> `[s_loc', b_loc', h]` in `output_layout`.

        `rotary_pos_emb` is the full-sequence table `[s, 1, 1, d]` (or None).
        """
        if hidden_states is None or not self.pre_process and self.input_tensor is not None:
            hidden_states = self.input_tensor  # pipeline input (set_input_tensor)
        hidden = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        group = self._groups.stage_group
        layout = self.input_layout
        # FP8 as TransformerBlock.forward applies it (transformer_block.py:711-764 at 0.16.1):
        # one outer autocast for the delayed recipe, one per layer otherwise (bf16 layers get
        # a null context from get_fp8_context)
        fp8 = self.config.fp8 is not None
        delayed = fp8 and self.config.fp8_recipe == "delayed"
        with get_fp8_context(self.config) if delayed else nullcontext():
            for build in self._builds:
                if build.layout != layout:
                    hidden = redistribute(hidden, layout, build.layout, group=group)
                    layout = build.layout
                inner = fp8 and not delayed
                with get_fp8_context(build.config, build.layer_idx) if inner else nullcontext():
                    hidden = self._run_layer(build, hidden, attention_mask,
                                             self._local_rope(rotary_pos_emb, layout))
        hidden = redistribute(hidden, layout, self.output_layout, group=group)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        hidden = make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)
        if not self.pre_process and hidden is self.input_tensor:
            hidden = hidden.clone()
        return hidden

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Global layer keys `{prefix}layers.{layer_idx}.*`, each layer sharded over its groups."""
        assert not sharded_offsets, "unexpected sharded offsets"
        out: dict = {}
        for build in self._builds:
            meta = {**(metadata or {}), "dp_cp_group": build.pg_collection.dp_cp}
            layer = self.layers[str(build.layer_idx)]
            out.update(layer_sharded_state_dict(  # ZeRO-2/3 layers: gathered tp shards
                layer, f"{prefix}layers.{build.layer_idx}.", (), meta))
        if self.final_layernorm is not None:
            meta = {**(metadata or {}), "dp_cp_group": self.pg_collection.dp_cp}
            out.update(sharded_state_dict_default(self.final_layernorm, f"{prefix}final_layernorm.",
                                                  (), meta, tp_group=self.tp_group))
        return out
