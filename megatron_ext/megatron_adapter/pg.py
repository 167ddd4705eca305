"""megatron-core `ProcessGroupCollection`s from the plan's groups, one per layout of the stage.

Groups come from `runtime/groups.py` (one communicator per distinct rank set). megatron-core's
`HyperCommGrid` is not used: each grid caches its own groups, so two strategies over the same
ranks would create the same rank set twice; one cache across all layouts avoids that.

Field meaning for a layout (tp, cp, seq = Ulysses, dp): `tp`, `cp` as Megatron; `dp` the pure
batch-split group; `dp_cp` (= `intra_dp_cp`) every stage rank with the same tp rank, i.e. all
replicas of a parameter shard: DDP reduces and the distributed optimizer shards over it.
Expert groups are singletons (dense models only).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.runtime.groups import PlanGroups
from megatron_ext.runtime.layout import Layout

__all__ = ["layout_pg_collection"]

def layout_pg_collection(groups: PlanGroups, layout: Layout) -> ProcessGroupCollection:
    """The collection layers (and DDP/optimizer) of `layout` on this stage use."""
    lg = groups.for_layout(layout)
    one = groups.singleton
    return ProcessGroupCollection(
        tp=lg.tp, cp=lg.cp, pp=groups.pp, embd=groups.embd, pos_embd=None,
        dp=lg.dp, dp_cp=lg.dp_cp, intra_dp_cp=lg.dp_cp, mp=None,
        ep=one, expt_tp=one, tp_ep=lg.tp, tp_ep_pp=None, expt_dp=one, intra_expt_dp=one,
        intra_dist_opt=dist.group.WORLD, inter_dist_opt=None,
    )
