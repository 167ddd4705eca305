"""End to end, 4 gloo ranks (tp=2 x dp=2, dropout on, mock data): what happens to checkpoints
when something goes wrong.

  R  the reference: 12 uninterrupted iterations, a checkpoint every 4.
  S  the same run with --exit-signal-handler, sent SIGTERM (every process of the job, as Slurm
     preemption does) once iteration 4 is logged, so while a later step runs: it saves at the
     end of that step and every rank exits 0; resuming from that save gives R's losses bit for
     bit (model, optimizer, scheduler, RNG and data position restored).
  D  R's checkpoint directory with one file damaged (each kind: common.pt, metadata.json,
     .metadata, a .distcp shard, the tracker): one line naming the file, the newest intact
     checkpoint and `--ckpt-step`; --ckpt-step 8 then continues R's losses bit for bit.
  B  a typo in --load while --save holds R's iteration 12: refused in one line before any
     process group; nothing in --save changes.
  F  --save on a file system with room for one checkpoint (a tmpfs of 1.6 times R's iteration
     4): the save of iteration 8 fails with one line naming the directory, ENOSPC and the bytes
     written; the tracker still names 4, no partial directory is left, and resuming from it
     gives R's losses bit for bit. The same with --async-save: the failure surfaces when the
     save is finalized, as the same line (the save of 4 may still be writing when 8 starts, so
     either can be the one that fails; an aborted async save may leave its iter_*.tmp, which
     is never named and is replaced by the next save of that iteration).
  A  R with --async-save, one writer process per save (Megatron-LM's default) or the persistent
     worker (--use-persistent-ckpt-worker --ckpt-assume-constant-structure): the same losses,
     the same published iterations; a resume from A's iteration 8 continues R bit for bit.
  K  --async-save, one rank SIGKILLed as soon as the save of iteration 8 is handed to the writer
     (its finalize, which publishes it, cannot have run yet): no iter_0000008 is published, the
     tracker names the last finalized save (4, or none when the write of 4 was still in flight
     too), and resuming gives R's losses bit for bit.
  S  also with --async-save: the exit handler waits for the save in flight.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.checkpoint_files import resolve_load

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
ERROR_LINE = re.compile(r"^pretrain_gpt.py: error: (.*)$", re.M)  # not torchrun's copy of it
FLAGS = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--num-workers", "0", "--tensor-model-parallel-size", "2",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "12",
    "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0",
]
TIMEOUT_S = 900  # generous: four ranks share two cores with whatever else runs on the machine


def _cmd(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "4", str(PRETRAIN), *FLAGS, *argv]


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(argv), check=False, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S, cwd=REPO)


def _losses(output: str) -> dict[int, str]:
    """Iteration -> the logged loss text (10 significant digits: exact for a float32 sum)."""
    return {int(it): loss for it, loss in LOSS_LINE.findall(output)}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    save = tmp_path_factory.mktemp("ops_reference")
    result = _torchrun(["--save", str(save), "--save-interval", "4"])
    assert result.returncode == 0, result.stdout[-4000:]
    losses = _losses(result.stdout)
    assert sorted(losses) == list(range(1, 13)), result.stdout[-3000:]
    return losses, save


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_sigterm_saves_at_the_end_of_the_step_and_resumes_bit_exactly(
        reference: tuple[dict[int, str], Path], tmp_path: Path, mode: list[str]) -> None:
    save = tmp_path / "preempted"
    proc = subprocess.Popen(_cmd(["--save", str(save), "--save-interval", "100",
                                  "--exit-signal-handler", *mode]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines, signalled = [], 0
    deadline = time.monotonic() + TIMEOUT_S
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not signalled and LOSS_LINE.search(line) and int(
                    LOSS_LINE.search(line)[1]) == 4:
                # Slurm signals every process of the job: the ranks and their children
                # (megatron-core's checkpoint-writer process), not torchrun's agent here.
                for pid in _descendants(proc.pid):
                    os.kill(pid, signal.SIGTERM)
                signalled = len(_descendants(proc.pid))
            assert time.monotonic() < deadline, "timed out"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    assert signalled >= 4, output[-3000:]
    assert proc.returncode == 0, output[-4000:]  # torchrun: every rank exited 0
    stopped = re.search(r"received SIGTERM: exiting after iteration (\d+)", output)
    assert stopped, output[-3000:]
    last = int(stopped[1])
    assert 4 <= last < 12, output[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(last)
    assert (save / f"iter_{last:07d}" / "manifest.json").is_file()
    expected, _ = reference
    assert _losses(output) == {i: expected[i] for i in range(1, last + 1)}

    resumed = _torchrun(["--load", str(save), "--save", str(save), "--save-interval", "100"])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert _losses(resumed.stdout) == {i: expected[i] for i in range(last + 1, 13)}


def _damage(ckpt: Path, kind: str) -> str:
    """Damage one file of iteration 12 (or the tracker); returns the file's name."""
    if kind == "tracker":
        (ckpt / "latest_checkpointed_iteration.txt").write_text("")
        return "latest_checkpointed_iteration.txt"
    d = ckpt / "iter_0000012"
    path = {"common.pt": d / "common.pt", "metadata.json": d / "metadata.json",
            ".metadata": d / ".metadata", "shard": sorted(d.glob("*.distcp"))[-1]}[kind]
    if kind in ("metadata.json", ".metadata"):
        path.write_bytes(b"")
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.name


@pytest.mark.parametrize("kind", ["common.pt", "metadata.json", ".metadata", "shard", "tracker"])
def test_each_damaged_file_is_named_with_the_intact_checkpoint(
        reference: tuple[dict[int, str], Path], tmp_path: Path, kind: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[1], ckpt)
    name = _damage(ckpt, kind)
    with pytest.raises(PlanError) as err:
        resolve_load(ckpt)
    message = str(err.value)
    assert name in message, message
    intact = 12 if kind == "tracker" else 8  # the tracker's loss leaves every directory intact
    assert message.endswith(f"the newest intact one is iteration {intact}: add --ckpt-step "
                            f"{intact} to load it"), message


def test_damaged_checkpoint_is_one_line_and_ckpt_step_loads_the_intact_one(
        reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    expected, source = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    shard = _damage(ckpt, "shard")
    refused = _torchrun(["--load", str(ckpt)])
    assert refused.returncode != 0
    errors = ERROR_LINE.findall(refused.stdout)
    assert len(errors) == 1, refused.stdout[-3000:]  # rank 0 only, one line
    assert f"checkpoint iteration 12 is damaged ({shard} has " in errors[0], errors
    assert errors[0].endswith("add --ckpt-step 8 to load it"), errors
    assert "Traceback" not in refused.stdout.split("pretrain_gpt.py: error:")[0]

    resumed = _torchrun(["--load", str(ckpt), "--ckpt-step", "8", "--exit-interval", "10"])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert _losses(resumed.stdout) == {9: expected[9], 10: expected[10]}


def test_typo_in_load_is_refused_before_rolling_save_back(
        reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    _, save = reference
    before = {p.name: p.stat().st_mtime_ns for p in save.rglob("*")}
    result = _torchrun(["--load", str(tmp_path / "chekpoints"), "--save", str(save),
                        "--save-interval", "4"])
    assert result.returncode != 0
    errors = ERROR_LINE.findall(result.stdout)
    assert len(errors) == 1, result.stdout[-3000:]
    assert errors[0].startswith(f"--save={save} holds iteration 12, but this run starts from "
                                "iteration 0"), errors
    assert f"pass --load {save} to resume it" in errors[0]
    assert not LOSS_LINE.search(result.stdout)
    assert {p.name: p.stat().st_mtime_ns for p in save.rglob("*")} == before


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_full_disk_is_one_line_and_the_last_checkpoint_resumes(
        reference: tuple[dict[int, str], Path], tmp_path: Path, mode: list[str]) -> None:
    expected, source = reference
    size = sum(f.stat().st_size for f in (source / "iter_0000004").rglob("*") if f.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.6) >> 10}k",
                              "tmpfs", str(disk)], check=False, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        result = _torchrun(["--save", str(disk), "--save-interval", "4", *mode])
        assert result.returncode != 0, result.stdout[-3000:]
        errors = ERROR_LINE.findall(result.stdout)
        assert len(errors) == 1, result.stdout[-3000:]  # rank 0 only, one line
        assert "Traceback" not in result.stdout.split("pretrain_gpt.py: error:")[0]
        failed = 8
        if mode:  # async: the save of 4 may still be writing when 8 starts, then both share
            # the room for one and either can be the one that fails
            found = re.match(r"could not save iteration (\d+) to ", errors[0])
            assert found and found[1] in ("4", "8"), errors
            failed = int(found[1])
        assert errors[0].startswith(f"could not save iteration {failed} to {disk}/iter_"
                                    f"{failed:07d}.tmp: No space left on device (ENOSPC"), errors
        if failed == 4:
            assert "no earlier checkpoint was published there" in errors[0], errors
            assert resolve_load(disk) is None  # nothing partial is ever named
            return
        assert re.search(r", after [1-9]\d* bytes were written; latest_checkpointed_iteration"
                         rf"\.txt still names iteration 4, which resumes with --load {disk};",
                         errors[0]), errors
        assert (disk / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
        published = sorted(p.name for p in disk.iterdir() if not p.name.endswith(".tmp"))
        assert published == ["iter_0000004", "latest_checkpointed_iteration.txt"]
        if not mode:  # sync: the failed save's directory is removed too
            assert sorted(p.name for p in disk.iterdir()) == published

        resumed = _torchrun(["--load", str(disk), "--exit-interval", "6"])
        assert resumed.returncode == 0, resumed.stdout[-4000:]
        assert _losses(resumed.stdout) == {5: expected[5], 6: expected[6]}
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _published(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir())


@pytest.mark.parametrize("writer", [[], ["--use-persistent-ckpt-worker",
                                         "--ckpt-assume-constant-structure"]],
                         ids=["temporal", "persistent"])
def test_async_save_publishes_the_same_checkpoints_and_resumes_bit_exactly(
        reference: tuple[dict[int, str], Path], tmp_path: Path, writer: list[str]) -> None:
    expected, _ = reference
    save = tmp_path / "async"
    result = _torchrun(["--save", str(save), "--save-interval", "4", "--async-save", *writer])
    assert result.returncode == 0, result.stdout[-4000:]
    assert _losses(result.stdout) == expected  # saving in the background changes no step
    for iteration in (4, 8, 12):
        assert f"saving checkpoint at iteration {iteration} to {save} in the background" \
            in result.stdout
        assert f"checkpoint of iteration {iteration} published under {save}" in result.stdout
    assert _published(save) == ["iter_0000004", "iter_0000008", "iter_0000012",
                                "latest_checkpointed_iteration.txt"]
    assert resolve_load(save).iteration == 12  # tracker, manifest and every file intact

    resumed = _torchrun(["--load", str(save), "--ckpt-step", "8", "--exit-interval", "10"])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert _losses(resumed.stdout) == {9: expected[9], 10: expected[10]}


def _kill_pipe_writers(fd: int) -> None:
    """SIGKILL every other process that holds the pipe `fd` reads from."""
    inode = f"pipe:[{os.fstat(fd).st_ino}]"
    for proc_dir in Path("/proc").glob("[0-9]*"):
        if int(proc_dir.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(f) == inode for f in (proc_dir / "fd").iterdir()):
                os.kill(int(proc_dir.name), signal.SIGKILL)


def test_rank_killed_during_an_async_save_leaves_the_previous_checkpoint(
        reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    expected, _ = reference
    save = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(["--save", str(save), "--save-interval", "4", "--async-save"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    lines, killed = [], None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "saving checkpoint at iteration 8 " in line:
                # the save of 8 is with the writers; its finalize runs after a later step at
                # the earliest, so nothing of 8 is published yet: kill a rank now
                ranks = [int(c) for task in Path(f"/proc/{proc.pid}/task").glob("*")
                         for c in (task / "children").read_text().split()]
                killed = sorted(ranks)[-1]
                os.kill(killed, signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "timed out"
        proc.wait(timeout=TIMEOUT_S)  # torchrun stops the other ranks and exits
    finally:
        # what a job's end does (Slurm kills every process of the job step): the killed
        # rank's helper processes (the writer's results-queue Manager ignores SIGTERM and runs
        # in a session of its own) would outlive it and keep the output pipe open
        with contextlib.suppress(ProcessLookupError):  # none left
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        _kill_pipe_writers(proc.stdout.fileno())
    assert proc.stdout is not None
    lines.append(proc.stdout.read())
    output = "".join(lines)
    assert killed is not None, output[-3000:]
    assert proc.returncode != 0, output[-3000:]
    assert "checkpoint of iteration 8 published" not in output
    assert not (save / "iter_0000008").exists()  # at most iter_0000008.tmp, never published
    # the save of 4 is published if its finalize ran before the kill (on a loaded machine the
    # write can take longer than four steps): the tracker names it then, nothing otherwise
    last = 4 if "checkpoint of iteration 4 published" in output else 0
    target = resolve_load(save)
    assert (target.iteration if target is not None else 0) == last, output[-3000:]
    assert _losses(output) == {i: expected[i] for i in _losses(output)}

    resumed = _torchrun(["--load", str(save), "--save", str(save), "--save-interval", "4",
                         "--async-save", "--exit-interval", "9"])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert _losses(resumed.stdout) == {i: expected[i] for i in range(last + 1, 10)}
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "9"
    assert resolve_load(save).iteration == 9  # leftover iter_*.tmp directories were replaced


def test_checkpoint_of_a_newer_schema_is_one_line_before_any_process_group(
        reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[1], ckpt)
    manifest = ckpt / "iter_0000012" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"version": 1', '"version": 2', 1))
    result = _torchrun(["--load", str(ckpt)])
    assert result.returncode != 0
    errors = ERROR_LINE.findall(result.stdout)
    assert len(errors) == 1, result.stdout[-3000:]
    assert errors[0].startswith(f"--load={ckpt}: checkpoint iteration 12 was written with "
                                "checkpoint schema version 2 (iter_0000012/manifest.json), "
                                "newer than this megatron_ext reads (1)"), errors
    assert "Traceback" not in result.stdout.split("pretrain_gpt.py: error:")[0]  # torchrun's after
    assert "plan:" not in result.stdout  # refused before the process group and the plan
