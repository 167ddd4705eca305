"""megatron-core `ProcessGroupCollection`s from the plan's groups, one per layout of the stage.

Groups come from `runtime/groups.py` (one communicator per distinct rank set). megatron-core's
`HyperCommGrid` is not used: each grid caches its own groups, so two strategies over the same
ranks would create the same rank set twice; one cache across all layouts avoids that.

Field meaning for a layout (tp, cp, ulysses, dp): `tp`, `cp` as Megatron; `dp` the pure
batch-split group; `dp_cp` (= `intra_dp_cp`) every stage rank with the same tp rank, i.e. all
replicas of a parameter shard: DDP reduces and the distributed optimizer shards over it.
Dense layers get singleton expert groups; MoE layers (`moe_pg_collection`) get their layout's
token-block group `tp_cp` (the router sums expert counts over it), the stage as `tp_dp_cp`
(global aux loss) and the expert groups of their (ep, etp) (runtime/groups.py): `ep`,
`expt_tp`, `tp_ep`, `expt_dp` = `intra_expt_dp` (expert gradient replicas), which megatron-core's
MoELayer, router, token dispatchers and experts read from the collection they are given.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["layout_pg_collection", "moe_pg_collection"]

def layout_pg_collection(groups: PlanGroups, layout: ActivationLayout) -> ProcessGroupCollection:
    """The collection layers (and DDP/optimizer) of `layout` on this stage use."""
    lg = groups.for_layout(layout)
    one = groups.singleton
    return ProcessGroupCollection(
        tp=lg.tp, cp=lg.cp, pp=groups.pp, embd=groups.embd, pos_embd=None,
        dp=lg.dp, dp_cp=lg.dp_cp, intra_dp_cp=lg.dp_cp, mp=None,
        ep=one, expt_tp=one, tp_ep=lg.tp, tp_ep_pp=None, expt_dp=one, intra_expt_dp=one,
        intra_dist_opt=dist.group.WORLD, inter_dist_opt=None,
    )


def moe_pg_collection(groups: PlanGroups, layout: ActivationLayout, ep: int, etp: int
                      ) -> ProcessGroupCollection:
    """The collection of an MoE layer with `layout` and expert degrees (ep, etp)."""
    lg = groups.for_layout(layout)
    eg = groups.experts[(ep, etp)]
    assert lg.tp_cp is not None, f"{layout} has no MoE layer"
    return ProcessGroupCollection(
        tp=lg.tp, cp=lg.cp, pp=groups.pp, embd=groups.embd, pos_embd=None,
        dp=lg.dp, dp_cp=lg.dp_cp, intra_dp_cp=lg.dp_cp, mp=None, tp_cp=lg.tp_cp,
        tp_dp_cp=groups.stage_group,
        ep=eg.ep_group, expt_tp=eg.expt_tp, tp_ep=eg.tp_ep, tp_ep_pp=None, expt_dp=eg.expt_dp,
        intra_expt_dp=eg.expt_dp, intra_dist_opt=dist.group.WORLD, inter_dist_opt=None,
    )
