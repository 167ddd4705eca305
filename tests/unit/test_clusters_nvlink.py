"""NVLink domains separate from nodes (GB200/GB300 NVL72: 72 GPUs on one fabric, 4 per tray):
the presets, the cluster file's field and its checks, the comm model's notion of leaving NVLink,
and a search that uses the domain for groups larger than 8 when the cost model says it is faster."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.search import SearchOptions, search
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import CLUSTER_PRESETS, cluster_preset, model_preset
from megatron_ext.specs import ClusterSpec


def test_presets_of_today():
    for name, domain, per_node in (("dgx-h100", 8, 8), ("dgx-b200", 8, 8),
                                   ("gb200-nvl72", 72, 4), ("gb300-nvl72", 72, 4)):
        c = CLUSTER_PRESETS[name]
        assert (c.nvlink_domain, c.gpus_per_node) == (domain, per_node)
        assert c.peak_fp8_flops == pytest.approx(2 * c.peak_flops, rel=0.01)
    assert "mxfp8" in CLUSTER_PRESETS["gb200-nvl72"].fp8_recipes
    assert "mxfp8" not in CLUSTER_PRESETS["dgx-h100"].fp8_recipes
    assert CLUSTER_PRESETS["dgx-a100-80g"].peak_fp8_flops == 0  # Ampere has no FP8
    # NVLink 5 busbw twice NVLink 4's; an 800 Gb/s NIC twice a 400 Gb/s one
    b200, gb300 = CLUSTER_PRESETS["dgx-b200"], CLUSTER_PRESETS["gb300-nvl72"]
    h100 = CLUSTER_PRESETS["dgx-h100"]
    assert b200.intra_node.bandwidth_bytes_per_s == 2 * h100.intra_node.bandwidth_bytes_per_s
    assert gb300.inter_node.bandwidth_bytes_per_s == 2 * h100.inter_node.bandwidth_bytes_per_s


def test_cluster_json_round_trips_and_older_files_load():
    c = cluster_preset("gb200-nvl72", num_nodes=36)  # two racks
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    old = cluster_preset("dgx-a100-80g").to_dict()
    assert "nvlink_domain_size" not in old and "peak_fp8_flops" not in old  # unchanged JSON
    loaded = ClusterSpec.from_dict(old)
    assert loaded.nvlink_domain == loaded.gpus_per_node == 8


@pytest.mark.parametrize("change, field", [
    ({"nvlink_domain_size": 6}, "nvlink_domain_size=6 must be a multiple of gpus_per_node=4"),
    ({"num_nodes": 20}, "nvlink_domain_size=72 does not divide the job's 80 GPUs"),
    ({"fp8_recipes": ("delayed", "nvfp8")}, "fp8_recipes has 'nvfp8'"),
])
def test_bad_nvlink_domain_is_one_line(change, field):
    with pytest.raises(PlanError) as err:
        dataclasses.replace(CLUSTER_PRESETS["gb200-nvl72"], **change)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_a_group_leaves_nodes_but_not_nvlink():
    """16 ranks over 4 trays of an NVL72 rack stay on NVLink; on DGX they cross nodes."""
    model, training = model_preset("llama3-8b"), TrainingSpec(global_batch_size=8, seq_length=2048)
    nvl = CostModel(model, cluster_preset("gb200-nvl72", num_nodes=16), training)
    dgx = CostModel(model, cluster_preset("dgx-b200", num_nodes=8), training)
    assert not nvl.layout(16, 1).crosses_nodes and nvl.layout(16, 1).ranks_per_node == 16
    assert dgx.layout(16, 1).crosses_nodes
    nbytes = 2.0**30
    t_nvl = nvl.comm.time_s("all_reduce", nbytes, nvl.layout(16, 1))
    t_dgx = dgx.comm.time_s("all_reduce", nbytes, dgx.layout(16, 1))
    assert t_nvl < t_dgx / 1.9  # 720 GB/s NVLink against 8 NICs x 45 GB/s = 360 GB/s


def test_405b_search_on_nvl72_uses_groups_beyond_8_when_faster():
    """Llama 3.1 405B on 64 GB200 (16 trays of one NVL72 rack). Its 8 query groups cap TP at 8,
    so a model-parallel group beyond 8 is tp x cp. The search's choice is checked with the cost
    model's own numbers: it places a group larger than 8 inside the NVLink domain; the best
    layout whose groups stay within 8 (no context parallelism) is slower; and on the same
    cluster with an 8-GPU NVLink domain (DGX-like) the chosen layout's group leaves NVLink and
    prices slower. Uniform search: what Megatron-LM expresses (MLPerf's NVL72 405B runs use
    tp x cp groups of 8-16 inside one rack), and seconds instead of a minute on two cores."""
    model = model_preset("llama3-405b")
    cluster = cluster_preset("gb200-nvl72", num_nodes=16)
    options = SearchOptions(uniform_only=True, explain_infeasible=False)

    def cost_model(cluster: ClusterSpec, allow_cp: bool) -> CostModel:
        return CostModel(model, cluster, TrainingSpec(global_batch_size=16, seq_length=8192,
                                                      allow_cp=allow_cp))

    cm = cost_model(cluster, True)
    plan = search(cm, options=options).plan
    group = max(s.tp * s.cp * s.ulysses for s in plan.layers)
    assert group > 8
    assert not cm.layout(group, 1).crosses_nodes  # inside the NVLink domain
    chosen_s = evaluate(cm, plan.layout).iteration_s
    within_8 = search(cost_model(cluster, False), options=options).plan
    assert max(s.tp * s.cp * s.ulysses for s in within_8.layers) <= 8
    assert chosen_s < evaluate(cm, within_8.layout).iteration_s
    dgx_like = cost_model(dataclasses.replace(cluster, nvlink_domain_size=8), True)
    assert dgx_like.layout(group, 1).crosses_nodes
    assert evaluate(dgx_like, plan.layout).iteration_s > chosen_s
