"""Megatron-LM's gradient numerics on every backend (2 gloo ranks each): with --bf16, gradients
accumulate and all-reduce in fp32 (`main_grad` fp32; Megatron-LM's validate_args forces
accumulate_allreduce_grads_in_fp32 for bf16) unless --grad-reduce-in-bf16; the NaN/Inf gradient
check is on unless --no-check-for-nan-in-loss-and-grad. Each backend is built through
select.build_backend from parsed flags, as pretrain_gpt.py builds it."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "32", "--position-embedding-type",
        "rope", "--vocab-size", "100", "--micro-batch-size", "1", "--lr", "1e-3",
        "--train-iters", "1", "--attention-dropout", "0", "--bf16", "--cpu",
        "--transformer-impl", "local"]
BACKEND_FLAGS = {
    "stock": ["--tensor-model-parallel-size", "2"],
    "layerwise": ["--context-parallel-size", "2"],  # no transformer-engine: the ring attention
    "flexsp": ["--flexsp", "--flexsp-max-group-size", "2"],
}
CASES = {  # extra flags -> (main_grad dtype, NaN check in the DDP config)
    "default": ([], torch.float32, True),
    "bf16 reduce": (["--grad-reduce-in-bf16", "--no-check-for-nan-in-loss-and-grad"],
                    torch.bfloat16, False),
}


def _build(rank: int, world_size: int, backend_flags: list[str]) -> dict[str, tuple]:
    from megatron.core import parallel_state

    from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
    from megatron_ext.megatron_adapter.cpu import compat
    from megatron_ext.megatron_adapter.training.run_config import build_run_config
    from megatron_ext.megatron_adapter.training.select import build_backend

    compat.apply(force=True)  # as pretrain_gpt.py --cpu does
    out = {}
    for case, (extra, _, _) in CASES.items():
        ns = parse_megatron_args([*BASE, *backend_flags, *extra], world_size=world_size)
        plan = plan_from_megatron_args(ns, world_size)
        run = build_run_config(ns, plan, cpu=True, have_te=False, have_wgrad_kernel=False)
        backend = build_backend(run, 128, eod=0)
        params = [p for chunk in backend.model for p in chunk.parameters() if p.requires_grad]
        ddps = [d for chunk in backend.model for d in getattr(chunk, "ddps", [chunk])]
        out[case] = (backend.name, {p.main_grad.dtype for p in params},
                     {p.dtype for p in params}, {d.ddp_config.check_for_nan_in_grad for d in ddps})
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("name", sorted(BACKEND_FLAGS))
def test_bf16_gradients_are_fp32_by_default(name: str) -> None:
    results = run_distributed(_build, world_size=2, timeout_s=300,
                              backend_flags=BACKEND_FLAGS[name])
    for rank, result in enumerate(results):
        for case, (_, grad_dtype, nan_check) in CASES.items():
            backend, grad_dtypes, param_dtypes, nan_checks = result[case]
            assert backend == name, (rank, case, backend)
            assert param_dtypes == {torch.bfloat16}, (rank, case, param_dtypes)
            assert grad_dtypes == {grad_dtype}, (rank, case, grad_dtypes)
            assert nan_checks == {nan_check}, (rank, case, nan_checks)
