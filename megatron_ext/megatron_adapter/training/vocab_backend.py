"""Vocabulary parallelism on the layerwise runtime (Yeung et al. 2025): the backend of plans
with `vocab.mode = vocab_parallel`.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden; `_loc` = this rank's block.

`build_model` builds every stage as a body (`HeteroGPTModel`, no embedding / output layer) that
holds its vocabulary shards (`model.vocab`) and takes / returns the vocabulary passes' layout
(geometry/vocab.py) on the first / last stage. The stage boundaries keep the runtime's
shapes (`geometry.stages.stage_shapes`: the sending stage's last-layer layout), the vocabulary
passes work on `[s_loc, b_loc, h]` of that layout, and vocab/schedule.py's 1F1B runs them.
Every rank reads the rows of every micro-batch its vocabulary layout gives it; each slices its
part. Everything else (data shard, losses, checkpoints) is the layerwise backend's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_ext.geometry.stages import stage_shapes
from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.megatron_adapter.losses import forward_step, vocab_view
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.megatron_adapter.training.backend import BackendName, Batch
from megatron_ext.megatron_adapter.training.layerwise_backend import LayerwiseBackend
from megatron_ext.megatron_adapter.vocab.schedule import schedule_for_plan

__all__ = ["VocabParallelBackend"]


@dataclass(kw_only=True, eq=False)
class VocabParallelBackend(LayerwiseBackend):
    """The layerwise backend with the vocabulary-parallel 1F1B schedule (module docstring)."""

    name: ClassVar[BackendName] = "vocab_parallel"

    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Extra `VocabScheduleOptions` fields (pass_timer: benchmarks)."""

    def _schedule(self, data: Iterator[Batch] | None, num_microbatches: int,
                  forward_only: bool) -> list[dict]:
        plan, groups = self.plan, self.groups
        inner: HeteroGPTModel = self.model[0].module
        assert inner.vocab is not None and inner.vocab_groups is not None, "built without vocab"
        config = inner.config
        hidden = config.hidden_size
        s_loc, b_loc = vocab_parallel_layout(plan).local_shape(plan.seq_length,
                                                               plan.micro_batch_size)
        block = (s_loc, b_loc, hidden)  # [s_loc, b_loc, h]
        (recv,), (send,) = stage_shapes(plan, groups.stage, hidden)  # () at the pipeline ends
        schedule = schedule_for_plan(
            plan, inner.vocab_groups, p2p_shapes=(recv or block, send or block),
            hidden_shape=block, select_tokens=inner.vocab_tokens, **self.schedule_options)
        step = self.forward_step_func or partial(forward_step, vocab_view, self.check_nan)
        return schedule(
            forward_step_func=step, data_iterator=data, model=self.model,
            num_microbatches=num_microbatches, seq_length=plan.seq_length,
            micro_batch_size=plan.micro_batch_size, forward_only=forward_only,
            p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=config),
            pg_collection=inner.pg_collection)
