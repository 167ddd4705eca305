"""What-if checks of the cost model's missing tensor-parallel cost on Jean Zay (BLOOM's topology
search, issue 19): which physical cause fits the measured runs, and which does not.

    python tools/bench_tp_gap.py [--json OUT.json]

tools/bench_published.py predicts BLOOM's 181B layouts on 384 A100 of Jean Zay at 0.71-0.97 of
measured at TP=8 (the lowest at micro-batch 1-2), 0.89-1.00 at TP=4 and 0.97-1.02 at TP=2.
This tool prices the same rows (and the chronicle's single-node runs of the same width) under
each candidate cause and prints, per candidate, the median |error| of all published rows, the
BLOOM rows' predicted/measured range and the ranking of the BLOOM sweeps:

  1. single node: the chronicle's "Max possible TFLOPs check" (1 node, TP=8, PP=1, DP=1, same
     NHIDDEN=14336 / NHEADS=64, 6 or 10 layers, GBS 512, 02-21): no network, no pipeline;
  2. intra-node bandwidth: the jean-zay rows' NVLink bus bandwidth lowered from the DGX's
     230 GB/s (a node whose GPUs are not all NVLink-connected would show this);
  3. GEMM wave quantization: every weight GEMM's forward time divided by its last wave's
     occupancy on the A100's 108 SMs (tiles = ceil(m / tile_m) x ceil(n / tile_n); NVIDIA's
     "Matrix multiplication background" guide; backward, 2x forward, with it), applied to
     every row (a GPU property), then with gemm_efficiency refitted without the BLOOM rows;
  4. a fixed cost per collective step: the jean-zay rows' intra-node hop latency raised from
     NCCL's 3.4 us (Simple ring over NVLink), 2 (t - 1) hops per all-reduce, priced by NCCL's
     own algorithm and protocol model on that link. The shipped model prices these calls by
     the A100 node's measured all-reduce (cost/measured_nccl.py): ~0.5 ms per 8-way
     all-reduce of BLOOM's 59 MB activations, within 2% of NCCL's model at that size, and ~2 ms
     short of what the gap needs per collective;
  5. measurement noise: the Spearman a perfect model reaches on the 11-layout sweep when each
     measured time carries lognormal noise of the given size (one iteration's Sec/it);
  6. synchronous launches: the chronicle adopts `CUDA_LAUNCH_BLOCKING=1` against hangs at 320
     GPUs just before the topology search ("dealing with JZ hanging on the large model"), so the
     rows state it (kernel_profile host_overlap_power 1: host and GPU time add); the candidate
     "asynchronous launches" prices them without it. The same section measures a 200B model
     with and without it (LAUNCH_BLOCKING_PAIRS): the check prints the slowdown the cost model
     predicts for each pair next to the measured one.

Nothing here changes the shipped cost model; a candidate patches calibration/scoring.py's
cluster_of / predict or cost/compute.py's layer_gemm_forward_s for its own duration only.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron_ext.calibration import scoring
from megatron_ext.calibration.ranking import spearman
from megatron_ext.calibration.rows import build_plan
from megatron_ext.calibration.rows import compute_of as rows_compute_of
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost import compute
from megatron_ext.planner.cost.compute import ArrayLike, ComputeProfile
from megatron_ext.specs import ClusterSpec, ModelSpec

JEAN_ZAY = "jean-zay-a100-80g"
A100_SMS = 108

# The chronicle's single-node runs of the same width (chronicles-prequel.md @ 59a90eec97d9,
# "Max possible TFLOPs check for NHIDDEN=14336", NLAYERS=6 and 10, GBS=512: the table's GBS
# column says 2048, but its TFLOPs column is eq.(3) of GBS 512, e.g. 10 layers: 2.34e17 FLOPs /
# (205.52 s x 8 GPUs) = 142.6 TFLOP/s as printed; the two 6-layer rows are the same layout run
# twice).
SINGLE_NODE = [
    {"num_layers": 6, "micro_batch_size": 2, "iter_time_s": 130.43, "quote": "|     1 | 18B  |      6 |  8 |  1 |   2 | 2048 | 54GB | 130.43 | 143.48 | 02-21 |"},  # noqa: E501
    {"num_layers": 6, "micro_batch_size": 2, "iter_time_s": 119.19, "quote": "|     1 | 18B  |      6 |  8 |  1 |   2 | 2048 | 54GB | 119.19 | 157.02 | 02-21 |"},  # noqa: E501
    {"num_layers": 10, "micro_batch_size": 1, "iter_time_s": 205.52, "quote": "|     1 | 18B  |     10 |  8 |  1 |   1 | 2048 | 80GB | 205.52 | 142.59 | 02-21 |"},  # noqa: E501
]


# The chronicle's runs of its 200B model with and without synchronous launches (same file,
# "dealing with JZ hanging on the large model", "200B, measuring 2nd iter"; the 200B layout of
# its "Best TFLOPs" section: TP=8, PP=10, NLAYERS=80, NHIDDEN=14400, NHEADS=96, SEQ_LEN=2048,
# micro-batch 1, DP = GPUs / 80). TFLOPs with CUDA_LAUNCH_BLOCKING=1 ("async no") and without;
# at the same global batch the time ratio is the inverse TFLOPs ratio.
LAUNCH_BLOCKING_PAIRS = [
    {"gpus": 80, "global_batch_size": 512, "tflops_blocking": 91.04, "tflops_async": 97.20},
    {"gpus": 160, "global_batch_size": 512, "tflops_blocking": 84.59, "tflops_async": 84.44},
    {"gpus": 160, "global_batch_size": 2048, "tflops_blocking": 90.29, "tflops_async": 90.25},
]
SYNCHRONOUS = {"host_overlap_power": 1.0}
"""kernel_profile of a run with CUDA_LAUNCH_BLOCKING=1 (ComputeProfile.host_overlap_power)."""


def launch_blocking_check(template: dict[str, Any]) -> list[dict[str, Any]]:
    """Per pair: the measured slowdown of synchronous launches (time with / time without) and
    the cost model's (SYNCHRONOUS over the default), on the 200B layout."""
    out = []
    for pair in LAUNCH_BLOCKING_PAIRS:
        r = {k: v for k, v in copy.deepcopy(template).items() if k != "kernel_profile"}
        r.update(id=f"bloom-200B-{pair['gpus']}gpus-gbs{pair['global_batch_size']}",
                 num_layers=80, hidden_size=14400, num_heads=96, num_kv_heads=96,
                 ffn_hidden_size=4 * 14400, tp=8, pp=10, dp=pair["gpus"] // 80,
                 num_gpus=pair["gpus"], global_batch_size=pair["global_batch_size"],
                 micro_batch_size=1, tflops_per_gpu=None)
        plan = build_plan(r)
        asynchronous = scoring.predict(r, plan)["predicted_s"]
        blocking = scoring.predict(dict(r, kernel_profile=SYNCHRONOUS), plan)["predicted_s"]
        out.append({**pair, "measured_slowdown": round(
            pair["tflops_async"] / pair["tflops_blocking"], 4),
            "predicted_slowdown": round(blocking / asynchronous, 4)})
    return out


def asynchronous_jean_zay(row: dict[str, Any], profile: ComputeProfile) -> ComputeProfile:
    """rows.compute_of with the jean-zay rows' synchronous launches taken out."""
    if row.get("cluster_label") == JEAN_ZAY:
        row = {k: v for k, v in row.items() if k != "kernel_profile"}
    return rows_compute_of(row, profile)


def single_node_rows(template: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate(SINGLE_NODE):
        r = copy.deepcopy(template)
        r.update(s, id=f"bloom-1node-{s['num_layers']}L-mb{s['micro_batch_size']}-{i}",
                 tp=8, pp=1, dp=1, num_gpus=8, global_batch_size=512, tflops_per_gpu=None,
                 run_date="2022-02-21 1 node")
        out.append(r)
    return out


def is_bloom(r: dict[str, Any]) -> bool:
    return r.get("cluster_label") == JEAN_ZAY or r.get("cluster") == JEAN_ZAY


def score(rows: list[dict[str, Any]], extra: list[dict[str, Any]]) -> dict[str, Any]:
    out = scoring.run(rows, loso=False)
    bloom = [r for r in out["rows"] if is_bloom(r)]
    single = [scoring.predict(r, build_plan(r))["predicted_s"] / r["iter_time_s"] for r in extra]
    by_tp: dict[str, list[float]] = {}
    for r in bloom:
        by_tp.setdefault(r["layout"].split()[0], []).append(r["ratio"])
    return {
        "median_abs_error_all": out["summary"]["median_abs_error"],
        "median_abs_error_not_bloom": statistics.median(
            abs(r["ratio"] - 1) for r in out["rows"] if not is_bloom(r)),
        "bloom_ratio_by_tp": {k: [round(min(v), 3), round(max(v), 3)]
                              for k, v in sorted(by_tp.items())},
        "single_node_ratio": [round(x, 3) for x in single],
        "bloom_sweeps": [
            {"sweep": f"{s['cluster']} GBS {s['global_batch_size']}", "layouts": s["layouts"],
             "spearman": round(s["spearman"], 3), "top1_regret": round(s["top1_regret"], 3)}
            for s in out["sweeps"] if JEAN_ZAY in s["cluster"]],
    }


def with_patch(target: Any, name: str, value: Callable[..., Any], fn: Callable[[], Any]) -> Any:
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        return fn()
    finally:
        setattr(target, name, old)


def jean_zay_intra(bandwidth: float | None = None, latency: float | None = None
                   ) -> Callable[[dict[str, Any]], ClusterSpec]:
    orig = scoring.cluster_of

    def cluster_of(row: dict[str, Any]) -> ClusterSpec:
        c = orig(row)
        if row.get("cluster_label") != JEAN_ZAY:
            return c
        link = c.intra_node
        if bandwidth is not None:
            link = dataclasses.replace(link, bandwidth_bytes_per_s=bandwidth)
        if latency is not None:
            link = dataclasses.replace(link, latency_s=latency)
        return dataclasses.replace(c, intra_node=link)

    return cluster_of


def wave_quantized_gemm_s(tile_m: int, tile_n: int) -> Callable[..., ArrayLike]:
    orig = compute.layer_gemm_forward_s

    def layer_gemm_forward_s(model: ModelSpec, profile: compute.ComputeProfile, *,
                             tokens: ArrayLike, tp: ArrayLike, peak: float) -> ArrayLike:
        total: ArrayLike = 0.0
        for k, n in compute.layer_gemms(model, tp):
            smallest = np.minimum(np.minimum(tokens, k), n)
            tiles = np.ceil(tokens / tile_m) * np.ceil(n / tile_n)
            occupancy = tiles / (np.ceil(tiles / A100_SMS) * A100_SMS)
            eff = compute.gemm_efficiency(profile, smallest) * occupancy
            total = total + 2.0 * tokens * k * n / (peak * eff)
        return total

    del orig
    return layer_gemm_forward_s


REFIT_GRID = tuple(round(0.72 + 0.02 * i, 2) for i in range(8))


def with_efficiency(g: float) -> Callable[..., dict[str, Any]]:
    orig = scoring.predict
    profile = compute.ComputeProfile(gemm_efficiency=g)

    def predict(row: dict[str, Any], plan: ParallelPlan,
                compute: ComputeProfile | None = None) -> dict[str, Any]:
        return orig(row, plan, profile)

    return predict


def noise_ceiling(measured: list[float], sigmas: list[float], trials: int = 4000
                  ) -> list[dict[str, float]]:
    rng = random.Random(0)
    out = []
    for sig in sigmas:
        rhos = []
        for _ in range(trials):
            noisy = [m * float(np.exp(rng.gauss(0.0, sig))) for m in measured]
            rhos.append(spearman(measured, noisy))
        out.append({"sigma": sig, "median_spearman": round(statistics.median(rhos), 3),
                    "p_at_least_0_8": round(sum(r >= 0.8 for r in rhos) / trials, 2)})
    return out



def ceiling_sweep(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep the noise ceiling is taken on: BLOOM's 2022-02-25 layouts at GBS 2048."""
    return [r for r in rows if r.get("cluster_label") == JEAN_ZAY
            and r.get("run_date") == "2022-02-25" and r["global_batch_size"] == 2048]


def candidates(rows: list[dict[str, Any]]
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every candidate scored on the published rows: (results, noise ceiling, the chronicle's
    single-node rows). launch_blocking_check prices the chronicle's 200B pairs."""
    template = next(r for r in rows if r.get("cluster_label") == JEAN_ZAY)
    extra = single_node_rows(template)
    results: list[dict[str, Any]] = []

    def add(name: str, res: dict[str, Any]) -> None:
        results.append({"candidate": name, **res})

    add("shipped model", score(rows, extra))
    for bw in (150e9, 100e9, 65e9):
        add(f"jean-zay NVLink busbw {bw / 1e9:.0f} GB/s", with_patch(
            scoring, "cluster_of", jean_zay_intra(bandwidth=bw), lambda: score(rows, extra)))
    for tm, tn in ((256, 128), (128, 128)):
        wave = wave_quantized_gemm_s(tm, tn)
        add(f"wave quantization {tm}x{tn} tiles, all rows", with_patch(
            compute, "layer_gemm_forward_s", wave, lambda: score(rows, extra)))
        # the same with gemm_efficiency refitted on the other sources (BLOOM held out)
        others = [r for r in rows if r.get("cluster_label") != JEAN_ZAY]
        fit: dict[float, float] = {}
        for g in REFIT_GRID:
            # mypy cannot infer a lambda whose parameters all have defaults (bound loop values)
            fit[g] = with_patch(compute, "layer_gemm_forward_s", wave, lambda g=g, o=others: (  # type: ignore[misc]
                with_patch(scoring, "predict", with_efficiency(g), lambda: scoring.run(
                    o, loso=False)["summary"]["median_abs_error"])))
        g = min(fit, key=lambda k: fit[k])
        add(f"  + gemm_efficiency {g:.2f} fitted without BLOOM", with_patch(
            compute, "layer_gemm_forward_s", wave, lambda g=g: with_patch(  # type: ignore[misc]
                scoring, "predict", with_efficiency(g), lambda: score(rows, extra))))
    for lat in (50e-6, 100e-6, 200e-6):
        add(f"jean-zay intra-node latency {lat * 1e6:.0f} us per ring step", with_patch(
            scoring, "cluster_of", jean_zay_intra(latency=lat), lambda: score(rows, extra)))
    add("jean-zay asynchronous launches (no CUDA_LAUNCH_BLOCKING)", with_patch(
        scoring, "compute_of", asynchronous_jean_zay, lambda: score(rows, extra)))
    big = ceiling_sweep(rows)
    ceiling = noise_ceiling([r["iter_time_s"] for r in big], [0.02, 0.03, 0.045, 0.065])

    return results, ceiling, extra
