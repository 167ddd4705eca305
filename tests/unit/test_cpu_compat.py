"""cpu_compat itself: registry, apply/undo, idempotence, reload safety, GPU no-op, behaviour."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterator
from pathlib import Path

import megatron.core.tensor_parallel as tp_pkg
import megatron.core.tensor_parallel.mappings as tp_mappings
import megatron.core.tensor_parallel.random as tp_random
import megatron.core.transformer.utils as transformer_utils
import pytest
import torch
from megatron.core.fusions import fused_softmax
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import dot_product_attention
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
from megatron_ext.megatron_adapter.cpu import patches as cpu_patches
from megatron_ext.megatron_adapter.cpu.torch_proxy import CpuTorchProxy, is_cuda_device

EXPECTED_NAMES = [
    "current_device",
    "causal_mask",
    "rng",
    "cuda_sync",
    "cuda_literals",
    "tensor_cuda",
    "type_alias",
    "cuda_streams",
    "te_gemm_stub",
    "stream_events",
    "host_splits",
    "uneven_gather",
    "mla_local_attention",
]


def _sites() -> dict[str, object]:
    """Every patched attribute, read the way callers see it."""
    return {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "Stream": torch.cuda.Stream,
        "stream": torch.cuda.stream,
        "Tensor.cuda": torch.Tensor.cuda,
        "Tensor.type": torch.Tensor.type,
        "schedules.torch": schedules.torch,
        "mask": transformer_utils.get_default_causal_mask,
        "fused_softmax.mask": fused_softmax.get_default_causal_mask,
        "get_rng": tp_random._get_cuda_rng_state,
        "add": tp_random.CudaRNGStatesTracker.add,
        "seed": tp_random.model_parallel_cuda_manual_seed,
        "seed_reexport": tp_pkg.model_parallel_cuda_manual_seed,
        "host_splits": moe_utils.maybe_move_tensor_to_cpu,
        "host_splits_dispatcher": token_dispatcher.maybe_move_tensor_to_cpu,
        "uneven_gather": tp_mappings._gather_along_first_dim,
        "uneven_scatter": tp_mappings._reduce_scatter_along_first_dim,
        "mla_local_attention": dot_product_attention.DotProductAttention.__init__,
    }


@pytest.fixture(autouse=True)
def clean_compat() -> Iterator[dict[str, object]]:
    """Start unpatched; afterwards leave the process exactly as it was found."""
    before = cpu_compat.applied()
    cpu_compat.undo()
    yield _sites()
    cpu_compat.undo()
    if before:
        cpu_compat.apply(before, force=True)


def test_registry_names_and_docs_cite_megatron_sites() -> None:
    assert list(cpu_compat.PATCHES) == EXPECTED_NAMES
    for patch in cpu_compat.PATCHES.values():
        assert ".py:" in patch.doc, f"{patch.name} docstring must cite a megatron-core file:line"


def test_apply_all_then_undo_restores_every_original(clean_compat: dict[str, object]) -> None:
    wanted = cpu_compat.for_version()  # this megatron-core's patches, in registry order
    assert cpu_compat.apply() == wanted
    assert cpu_compat.applied() == wanted
    patched = _sites()
    assert all(patched[k] is not clean_compat[k] for k in clean_compat), "some site unpatched"
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversions untouched
    t = torch.zeros(2)
    assert t.cuda() is t
    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    expected_mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)  # [sq, sq]
    assert torch.equal(fused_softmax.get_default_causal_mask(4), expected_mask)

    assert cpu_compat.undo() == tuple(reversed(wanted))
    assert cpu_compat.applied() == ()
    restored = _sites()
    assert all(restored[k] is clean_compat[k] for k in clean_compat), "some site not restored"
    assert "cuda" not in torch.Tensor.__dict__ and "type" not in torch.Tensor.__dict__
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_apply_is_idempotent_and_never_nests(clean_compat: dict[str, object]) -> None:
    cpu_compat.apply()
    first = _sites()
    assert cpu_compat.apply() == ()
    assert _sites() == first
    original = getattr(torch.cuda.current_device, cpu_patches.ORIGINAL)
    assert original is clean_compat["current_device"]


def test_reloaded_module_does_not_nest_and_can_undo(clean_compat: dict[str, object]) -> None:
    cpu_compat.apply()
    first = _sites()
    importlib.reload(cpu_patches)
    importlib.reload(cpu_compat)  # forgets what was applied; the stamps on wrappers remain
    assert cpu_compat.applied() == ()
    cpu_compat.apply()
    assert _sites() == first, "re-applying after reload must keep the installed wrappers"
    cpu_compat.undo()
    restored = _sites()
    assert all(restored[k] is clean_compat[k] for k in clean_compat)


def test_noop_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() == ()
    assert not cpu_patches.is_patched(torch.cuda, "current_device")
    assert cpu_compat.apply(["current_device"], force=True) == ("current_device",)
    assert cpu_patches.is_patched(torch.cuda, "current_device")


def test_selection_by_name_and_exclusion() -> None:
    assert cpu_compat.apply(["cuda_sync"]) == ("cuda_sync",)
    assert not cpu_patches.is_patched(torch.cuda, "current_device")
    assert cpu_compat.apply(exclude=["type_alias"]) == tuple(
        n for n in cpu_compat.for_version() if n not in ("cuda_sync", "type_alias")
    )
    assert not cpu_patches.is_patched(torch.Tensor, "type")
    assert cpu_compat.undo(["cuda_sync"]) == ("cuda_sync",)
    assert not cpu_patches.is_patched(torch.cuda, "synchronize")
    with pytest.raises(ValueError, match="no_such_patch"):
        cpu_compat.apply(["no_such_patch"])


def test_rng_tracker_forks_named_cpu_streams(caplog: pytest.LogCaptureFixture) -> None:
    cpu_compat.apply(["rng"])
    tracker = tp_random.CudaRNGStatesTracker()
    tracker.add("stream-a", 5)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING), tracker.fork("stream-a"):
        forked = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(forked, torch.rand(3)), "fork must draw from the named stream"
    torch.manual_seed(0)
    assert torch.equal(after_fork, torch.rand(3)), "fork must restore the outer stream"
    assert "CPU RNG state changed" not in caplog.text
    with pytest.raises(Exception, match="already exists"):
        tracker.add("stream-b", 5)


def test_model_parallel_seed_seeds_the_cpu_generator() -> None:
    cpu_compat.apply(["rng"])
    torch.manual_seed(99)
    tp_pkg.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))


def test_cuda_streams_are_inert() -> None:
    cpu_compat.apply(["cuda_streams"])
    stream = torch.cuda.Stream(device=torch.device("cpu"))
    stream.wait_stream(torch.cuda.default_stream())
    with torch.cuda.stream(stream):
        pass
    torch.cuda.current_stream().synchronize()


def test_torch_proxy_rewrites_only_cuda_device_keywords() -> None:
    proxy = CpuTorchProxy()
    assert proxy.nn is torch.nn and proxy.float32 is torch.float32
    for device in ("cuda", "cuda:1", torch.device("cuda", 0), 0):
        assert is_cuda_device(device)
        assert proxy.ones(2, device=device).device.type == "cpu"
    for device in (None, "cpu", torch.device("cpu"), True):
        assert not is_cuda_device(device)
    assert proxy.full((2,), 3.0, device="cpu").tolist() == [3.0, 3.0]
    assert proxy.empty_like(torch.zeros(2), device="cuda").device.type == "cpu"


def test_patch_versions_skip_what_the_installed_megatron_core_does_not_need() -> None:
    """Each patch names its megatron-core range; apply() installs only the imported version's."""
    assert cpu_compat.for_version("0.16.1") == tuple(EXPECTED_NAMES)
    on_019 = cpu_compat.for_version("0.19.2")
    assert on_019 == tuple(n for n in EXPECTED_NAMES if n != "te_gemm_stub")  # fixed upstream
    assert all(cpu_compat.PATCHES[n].versions == cpu_patches.ALL_VERSIONS for n in on_019)
    assert cpu_compat.for_version("0.20.0") == ()
    assert cpu_compat.megatron_core_version() == importlib.metadata.version("megatron-core")
    readme = (Path(__file__).resolve().parents[2] / "patches" / "README.md").read_text()
    for name, patch in cpu_compat.PATCHES.items():
        assert f"| `{name}` | {patch.versions} |" in readme, f"README: {name}'s versions"


def test_te_gemm_stub_binds_the_name_and_the_router_gemm_runs() -> None:
    """Without TE, RouterGatingLinearFunction raises NameError (moe_utils.py:1192) unless the
    stub binds te_general_gemm; with it, forward and backward equal plain torch matmuls. From
    0.19 megatron-core binds the name itself, and the patch is not applied."""
    assert not moe_utils.HAVE_TE
    inp = torch.randn(5, 8, requires_grad=True)  # [tokens, h]
    weight = torch.randn(4, 8, requires_grad=True)  # [experts, h]
    if "te_gemm_stub" not in cpu_compat.for_version():
        assert moe_utils.te_general_gemm is None  # the upstream fix the version range relies on
        assert cpu_compat.apply(["te_gemm_stub"]) == ()
    else:
        assert not hasattr(moe_utils, "te_general_gemm")
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    cpu_compat.apply(["te_gemm_stub"])
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)  # [tokens, experts]
    out.square().sum().backward()
    ref_inp, ref_w = inp.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (ref_inp @ ref_w.t()).square().sum().backward()
    torch.testing.assert_close(out, ref_inp @ ref_w.t())
    torch.testing.assert_close(inp.grad, ref_inp.grad)
    torch.testing.assert_close(weight.grad, ref_w.grad)
    cpu_compat.undo(["te_gemm_stub"])
    if "te_gemm_stub" in cpu_compat.for_version():
        assert not hasattr(moe_utils, "te_general_gemm")


def test_stream_events_dummy_stream_records_events() -> None:
    cpu_compat.apply(["cuda_streams"])
    torch.cuda.current_stream().wait_event(object())  # 0.19 start_grad_sync's wgrad events
    with pytest.raises(AttributeError, match="record_event"):
        torch.cuda.Stream().record_event()
    cpu_compat.apply(["stream_events"])
    event = torch.cuda.Stream().record_event()  # token_dispatcher.py:895
    event.synchronize()
    assert event.query()
    cpu_compat.undo(["stream_events"])
    assert not hasattr(torch.cuda.Stream(), "record_event")


def test_host_splits_returns_numpy_split_sizes_for_cpu_tensors() -> None:
    splits = torch.tensor([3, 1])
    assert moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True) is splits  # unpatched
    cpu_compat.apply(["host_splits"])
    for fn in (moe_utils.maybe_move_tensor_to_cpu, token_dispatcher.maybe_move_tensor_to_cpu):
        got = fn(splits, as_numpy=True, record_stream=True)
        assert not torch.is_tensor(got) and got.tolist() == [3, 1]
        assert fn(splits) is splits  # without as_numpy: unchanged, as the original
