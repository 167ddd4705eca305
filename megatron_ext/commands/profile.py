"""`megatron-ext profile hardware|model`: measure the cluster and a model for the cost model.

  torchrun --nproc-per-node 8 -m megatron_ext.cli profile hardware --out cluster_profile.json
  megatron-ext profile model --model llama2-7b --out model_profile.json

`hardware` runs under torchrun (NCCL on GPUs, gloo on CPU; nodes = WORLD_SIZE / LOCAL_WORLD_SIZE)
and writes the cluster profile from rank 0. `model` starts its own measuring processes. Both
print a summary table to stderr; the JSON goes to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from megatron_ext.errors import PlanError
from megatron_ext.planner.profile.profiles import ClusterProfile, ModelProfile


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure hardware or a model for the cost model")
    kinds = p.add_subparsers(dest="profile_kind", required=True, parser_class=type(p))
    hw = kinds.add_parser("hardware", help="collective curves + overlap (run under torchrun)")
    hw.add_argument("--out", required=True, help="cluster profile JSON to write (rank 0)")
    hw.add_argument("--min-bytes", type=int, default=None, help="smallest message (default "
                    "64 KiB on GPU, 4 KiB on CPU)")
    hw.add_argument("--max-bytes", type=int, default=None, help="largest message (default "
                    "1 GiB on GPU, 16 MiB on CPU)")
    hw.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    hw.add_argument("--ranks-per-node", type=int, default=None,
                    help="default: LOCAL_WORLD_SIZE (set by torchrun)")
    hw.add_argument("--nvlink-domain-size", type=int, default=None,
                    help="GPUs sharing one NVLink fabric, recorded in the profile (72 on "
                    "GB200/GB300 NVL72); default: the ranks per node")
    hw.set_defaults(run=run_hardware)
    mdl = kinds.add_parser("model", help="per-layer forward/backward/recompute times")
    which = mdl.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="model preset name")
    which.add_argument("--model-config", help="HuggingFace config.json or ModelSpec JSON")
    mdl.add_argument("--out", required=True, help="model profile JSON to write")
    mdl.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                     help="default bf16 on GPU, fp32 on CPU")
    mdl.add_argument("--tp", type=_int_list, default=(1, 2, 4), help="TP degrees, e.g. 1,2,4")
    mdl.add_argument("--micro-batch-sizes", type=_int_list, default=(1, 2, 4))
    mdl.add_argument("--seq-lengths", type=_int_list, default=None,
                     help="default: max_position_embeddings / 4 and / 2")
    mdl.add_argument("--repeats", type=int, default=3)
    mdl.add_argument("--concurrency", type=int, default=1, help="ranks that will share this "
                     "device (e.g. 4 gloo ranks on one CPU); their slowdown is measured "
                      "(1 on GPUs)")
    mdl.add_argument("--threads", type=int, default=None,
                     help="torch threads per process (default: OMP_NUM_THREADS or torch's)")
    mdl.set_defaults(run=run_model)


def require_runtime(command: str, *, megatron: bool) -> None:
    """The planner installs without torch and megatron-core (`pip install megatron_ext`); a
    runtime command run there, or on an unsupported megatron-core, stops in one line before any
    process group."""
    from megatron_ext.megatron_adapter.compat_versions import check_megatron_core

    if importlib.util.find_spec("torch") is None:
        raise PlanError(f"{command} needs torch, which is not installed; install the runtime: "
                        "pip install torch && pip install 'megatron_ext[train]'")
    if megatron:
        check_megatron_core()


def run_hardware(args: argparse.Namespace) -> int:
    require_runtime("profile hardware", megatron=False)
    import torch
    import torch.distributed as dist

    from megatron_ext.runtime.profile_hardware import profile_hardware

    domain = args.nvlink_domain_size
    if domain is not None and domain < 1:
        raise PlanError(f"--nvlink-domain-size={domain} must be >= 1 (GPUs on one NVLink "
                        "fabric: 8 on DGX, 72 on NVL72)")
    if "RANK" not in os.environ and not dist.is_initialized():
        raise PlanError("profile hardware must run under torchrun (RANK/WORLD_SIZE unset), e.g. "
                        "torchrun --nproc-per-node 8 -m megatron_ext.cli profile hardware --out F")
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    rank = dist.get_rank()
    def progress(msg: str) -> None:
        sys.stderr.write(f"profile hardware: {msg}\n")

    progress_fn = progress if rank == 0 else None
    try:
        profile = profile_hardware(world=dist.group.WORLD, device=device,
                                   local_world_size=args.ranks_per_node,
                                   min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                                   repeats=args.repeats, progress=progress_fn,
                                   nvlink_domain_size=domain or 0)
    except ValueError as err:
        raise PlanError(f"profile hardware: {err}") from None
    if rank == 0:
        profile.save(args.out)
        sys.stderr.write(cluster_summary(profile) + f"wrote {args.out}\n")
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    return 0


def cluster_summary(profile: ClusterProfile) -> str:
    c = profile.cluster
    lines = [(f"{profile.device}, {profile.backend}: {c.num_nodes} node(s) x {c.gpus_per_node} "
             f"ranks, NVLink domain {c.nvlink_domain}, peak {c.peak_flops / 1e12:.3g} TFLOP/s "
             f"per rank, overlap slowdown {profile.overlap_slowdown:.2f}, compute slots per node "
             f"{profile.compute_slots_per_node}, comm CPU share {profile.comm_cpu_share:.2f}"),
             (f"{'collective':<15}{'g':>3}{'stride':>7}{'per node':>9}{'latency us':>12}"
             f"{'GB/s @max':>11}")]
    for cv in profile.collectives:
        gbps = cv.num_bytes[-1] / cv.seconds[-1] / 1e9
        lines.append(f"{cv.collective:<15}{cv.group_size:>3}{cv.stride:>7}{cv.ranks_per_node:>9}"
                     f"{cv.fit.alpha_s * 1e6:>12.1f}{gbps:>11.3f}")
    return "\n".join(lines) + "\n"


def run_model(args: argparse.Namespace) -> int:
    require_runtime("profile model", megatron=True)
    import torch

    from megatron_ext.commands.moe_support import refuse_moe_profile
    from megatron_ext.megatron_adapter.profile_model import ProfileGrid, profile_model
    from megatron_ext.presets import model_from_file, model_preset

    model = model_preset(args.model) if args.model else model_from_file(args.model_config)
    refuse_moe_profile(model)
    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    seqs = args.seq_lengths or tuple(max(1, model.max_position_embeddings // d) for d in (4, 2))
    if args.repeats < 1 or args.concurrency < 1:
        raise PlanError(f"--repeats={args.repeats} and --concurrency={args.concurrency} must "
                        "be >= 1")
    threads = args.threads or (int(os.environ["OMP_NUM_THREADS"])
                               if os.environ.get("OMP_NUM_THREADS", "").isdigit() else None)
    try:
        grid = ProfileGrid(tps=args.tp, micro_batch_sizes=args.micro_batch_sizes,
                           seq_lengths=seqs, repeats=args.repeats)
        profile = profile_model(model, precision=precision, grid=grid,
                                concurrency=args.concurrency, threads=threads)
    except ValueError as err:
        raise PlanError(f"profile model: {err}") from None
    profile.save(args.out)
    sys.stderr.write(model_summary(profile) + f"wrote {args.out}\n")
    return 0


def model_summary(profile: ModelProfile) -> str:
    lines = [(f"{profile.model.name} on {profile.device} ({profile.precision}): "
             f"{len(profile.layers)} layer shapes, {len(profile.vocab)} vocabulary shapes, "
             f"{len(profile.optimizer)} optimizer sizes, times of one rank alone; "
             f"{profile.concurrency} ranks sharing the device compute "
             f"{profile.sharing_slowdown:.2f}x slower"),
             (f"{'tp':>3}{'sp':>4}{'b':>4}{'s':>6}{'fwd ms':>9}{'bwd ms':>9}{'rc ms':>8}"
             f"{'sel ms':>8}")]
    for s in profile.layers:
        lines.append(f"{s.tp:>3}{'y' if s.sp else 'n':>4}{s.micro_batch_size:>4}"
                     f"{s.seq_length:>6}{s.forward_s * 1e3:>9.2f}{s.backward_s * 1e3:>9.2f}"
                     f"{s.recompute_s * 1e3:>8.2f}{s.selective_recompute_s * 1e3:>8.2f}")
    lines.append("fit (median / max relative error): " + ", ".join(
        f"{k} {a:.0%}/{b:.0%}" for k, (a, b) in profile.fit_report().items()))
    return "\n".join(lines) + "\n"
