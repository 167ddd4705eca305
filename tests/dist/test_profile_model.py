"""Model profiler: `megatron-ext profile model` on tiny-gpt with two lockstep workers measures
every requested shape of the real megatron-core layer, its vocabulary layers and the optimizer,
writes a loadable profile, and rejects bad input with one line (exit 2). No speed is asserted."""

from __future__ import annotations

import pytest

from megatron_ext.cli import main
from megatron_ext.presets import model_preset
from megatron_ext.planner.profile.profiles import ModelProfile

pytestmark = pytest.mark.dist


def test_profile_model_cli_measures_every_shape(tmp_path, capsys):
    out = tmp_path / "model_profile.json"
    code = main(["profile", "model", "--model", "tiny-gpt", "--tp", "1,2",
                 "--micro-batch-sizes", "1,2", "--seq-lengths", "16,32", "--repeats", "1",
                 "--concurrency", "2", "--threads", "1", "--out", str(out)])
    assert code == 0
    profile = ModelProfile.load(out)
    assert profile.model == model_preset("tiny-gpt") and profile.concurrency == 2
    assert profile.sharing_slowdown >= 1.0 and profile.sharing_alone_s > 0
    shapes = {(s.tp, s.sp, s.micro_batch_size, s.seq_length) for s in profile.layers}
    assert shapes == {(tp, sp, b, s) for tp, sp in ((1, False), (2, False), (2, True))
                      for b in (1, 2) for s in (16, 32)}
    assert all(s.forward_s > 0 and s.backward_s > 0 and s.activation_bytes is None
               for s in profile.layers)  # CPU: time only, memory stays analytic
    assert {(v.tp, v.tokens) for v in profile.vocab} == {(tp, n) for tp in (1, 2)
                                                         for n in (16, 32, 64)}
    assert len(profile.optimizer) == 4 and profile.optimizer[1].num_params > \
        profile.optimizer[0].num_params
    assert set(profile.fit_report()) >= {"forward_s", "backward_s", "recompute_s",
                                         "output_forward_s", "optimizer_step_s"}
    assert "fit (median / max relative error)" in capsys.readouterr().err


def _probe_rank(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    from megatron_ext.megatron_adapter.profile_model import ProfileGrid, SharingProbe

    single, _ = dist.new_subgroups(group_size=1)
    grid = ProfileGrid(tps=(1, 2), micro_batch_sizes=(1, 2, 4), seq_lengths=(16, 32), repeats=1)
    probe = SharingProbe(model_preset("tiny-gpt"), precision="fp32", grid=grid, single=single)
    return [layer.key for layer in probe.stack], probe.steps_s()


def test_sharing_probe_runs_the_profilers_stack_inside_gloo_ranks():
    """The calibration benchmark's probe (planner/profile/load.py) inside 2 gloo ranks: the
    profiler's stack (every layer at tp 1, the middle micro-batch, the longest sequence), timed
    step by step on each rank at once; tp 1 only (no fake group to build wider shards)."""
    from megatron_ext.megatron_adapter.profile_model import ProfileGrid, SharingProbe
    from megatron_ext.runtime.testing import run_distributed

    out = run_distributed(_probe_rank, world_size=2, timeout_s=300)
    for keys, steps in out:
        assert keys == [(1, False, 2, 32)] * model_preset("tiny-gpt").num_layers
        assert steps and all(t > 0 for t in steps)
    with pytest.raises(ValueError, match="tp 1 only"):
        SharingProbe(model_preset("tiny-gpt"), precision="fp32", grid=ProfileGrid(tps=(2,)),
                     single=None)


@pytest.mark.parametrize("argv, needle", [
    (["--model", "tiny-gpt", "--tp", "3"], "tp=3 must divide"),
    (["--model", "tiny-gpt", "--tp", "2", "--seq-lengths", "15"], "multiples of tp=2"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "tiny-gpt", "--repeats", "0"], "--repeats=0"),
])
def test_profile_model_bad_input_is_one_line(tmp_path, capsys, argv, needle):
    code = main(["profile", "model", *argv, "--out", str(tmp_path / "m.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err


def test_profile_hardware_outside_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    code = main(["profile", "hardware", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "torchrun" in err and "\n" not in err
