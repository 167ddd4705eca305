"""examples/slurm/*.sh under a real Slurm: a one-node cluster on this machine (tests/slurm_cluster.py:
munged, slurmctld, slurmd; the node's CPUs, no GPUs), the scripts run unchanged with the CPU
settings docs/slurm.md documents (IMAGE=none, GPUS_PER_NODE=2 gloo ranks, --gpus-per-node=0).

  P  sbatch_profile.sh measures the 2 ranks; the search of the next job reads that profile.
  R  sbatch_train.sh: search -> args -> torchrun pretrain_gpt.py through srun, 2 ranks, rendezvous
     at the allocation's node; the log shows the plan and every iteration line. The reference.
  K  the same job's training killed without warning (SIGKILL to torchrun, the ranks and their
     checkpoint writers, as a node's crash or a cgroup kill does): the job fails; requeued with
     `scontrol requeue` it reuses its plan and resumes from its last periodic checkpoint. Then
     Slurm's preemption warning (`scancel --signal=TERM`): it saves, exits 0 (the job
     COMPLETED), and requeued once more it resumes from that iteration. Every loss it logs,
     in all three starts, equals R's for that iteration (bit-exact: model, optimizer, scheduler,
     RNG and data position are restored).
  B  bad input (no plan file, a plan for 4 ranks on a 2-rank allocation, a data path the job
     cannot read): the job fails before any rank starts, its log one line naming the problem.

Skipped, with the reason, only where slurm-wlm and munge are missing and cannot be installed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.corpus import write_corpus
from tests.slurm_cluster import LocalSlurm, SlurmUnavailable

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
START_LINE = re.compile(r"^job (\d+) on (\S+), start (\d+)$", re.M)
ITERS = 30
SAVE_INTERVAL = 10  # wide, so that the signals below land between two saves
TIMEOUT_S = 600  # one job; generous, as the 2 ranks share two cores with the rest of the suite
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    cluster = LocalSlurm(root=tmp_path_factory.mktemp("slurm"), cpus=os.cpu_count() or 1)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        pytest.skip(f"no local Slurm cluster: {e}")
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def job_env(slurm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The CPU settings (docs/slurm.md) and a tiny corpus with a HuggingFace tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    data = tmp_path_factory.mktemp("slurm_data")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while one small cat sat on a red mat".split()
    write_corpus(data, [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
                        for _ in range(200)])
    tok = Tokenizer(models.BPE.from_file(str(data / "gpt2-vocab.json"),
                                         str(data / "gpt2-merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        str(data / "tokenizer"))
    return dict(
        slurm.env, PATH=f"{Path(sys.executable).parent}:{slurm.env['PATH']}",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        IMAGE="none", GPUS_PER_NODE="2", MASTER_PORT=str(_free_port()),
        MODEL="tiny-gpt", GLOBAL_BATCH_SIZE="8", SEQ_LENGTH="32",
        SEARCH_ARGS="--precision fp32 --no-vocab-parallel",
        DATA_PATH=str(data / "corpus_text_document"), TOKENIZER_MODEL=str(data / "tokenizer"),
        TRAIN_ITERS=str(ITERS),
        EXTRA_ARGS=(f"--cpu --transformer-impl local --split 90,10,0 --lr-warmup-iters 1 "
                    f"--log-interval 1 --eval-iters 0 --num-workers 0 "
                    f"--save-interval {SAVE_INTERVAL}"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sbatch(slurm, script: str, env: dict[str, str], log: Path) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=0", f"--output={log}",
         str(REPO / "examples" / "slurm" / script)],
        env=env, cwd=REPO, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def _job(slurm, job: str) -> dict[str, str]:
    text = slurm.run("scontrol", "show", "job", "-o", job).stdout
    return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)


def _wait(slurm, job: str, log: Path, until=None) -> dict[str, str]:
    """Wait until the job has finished, or until `until(log text)` holds while it runs."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        text = log.read_text() if log.exists() else ""
        if until is not None and until(text):
            return _job(slurm, job)
        state = _job(slurm, job)
        if until is None and state.get("JobState") in FINISHED:
            return state
        assert state.get("JobState") not in FINISHED or until is None, (state, text[-3000:])
        assert time.monotonic() < deadline, f"timed out: {state}\n{text[-3000:]}"
        time.sleep(0.1)


def _python_processes(slurm, job: str) -> list[int]:
    """The job's Python processes: torchrun's agent, the ranks, their checkpoint writers (not the
    batch shell, srun or slurmstepd)."""
    pids = []
    for pid in slurm.job_processes(job):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if b"python" in Path(argv0.decode()).name.encode():
            pids.append(pid)
    assert len(pids) >= 3, pids
    return pids


def _losses(text: str) -> dict[int, str]:
    return {int(it): loss for it, loss in LOSS_LINE.findall(text)}


def _starts(text: str) -> list[str]:
    """The log of each start of the job (the script's first line opens each)."""
    cuts = [m.start() for m in START_LINE.finditer(text)]
    return [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]


@pytest.fixture(scope="module")
def reference(slurm, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[dict[int, str], Path, dict[str, str]]:
    """P then R: the profile job, then search -> train reading that profile."""
    out = tmp_path_factory.mktemp("slurm_jobs")
    env = dict(job_env, RUN_DIR=str(out / "profile"),
               PROFILE_ARGS="--max-bytes 262144 --repeats 2")
    log = out / "profile.log"
    state = _wait(slurm, _sbatch(slurm, "sbatch_profile.sh", env, log), log)
    profile = out / "profile" / "cluster_profile.json"
    assert state["JobState"] == "COMPLETED" and profile.is_file(), log.read_text()[-3000:]

    env = dict(job_env, RUN_DIR=str(out / "train"), CLUSTER_PROFILE=str(profile))
    log = out / "train.log"
    state = _wait(slurm, _sbatch(slurm, "sbatch_train.sh", env, log), log)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    return _losses(text), out / "train" / "plan.json", env


def test_profile_search_and_train_through_slurm(reference, slurm) -> None:
    losses, plan, env = reference
    log = Path(env["RUN_DIR"]).parent / "train.log"
    text = log.read_text()
    assert "measured-gloo" in text  # the search read the profile job's measurements
    assert f"wrote {plan}" in text and plan.is_file()
    assert re.search(r"plan: \S+ on 2 ranks \(cpu, gloo\)", text), text[-3000:]
    assert sorted(losses) == list(range(1, ITERS + 1)), text[-3000:]
    # the rendezvous at the allocation's first node, as `scontrol show hostnames` names it
    assert f"rendezvous at localhost:{env['MASTER_PORT']}" in text
    assert f"saved checkpoint at iteration {ITERS}" in text


def test_kill_preempt_requeue_resume_the_same_losses(reference, slurm, tmp_path: Path) -> None:
    expected, plan, reference_env = reference
    env = dict(reference_env, RUN_DIR=str(tmp_path / "run"))
    log = tmp_path / "job.log"
    job = _sbatch(slurm, "sbatch_train.sh", env, log)

    # 1. killed without warning after iteration SAVE_INTERVAL + 1: the periodic save is all
    # that survives. (`scancel --signal=KILL` would cancel the job, warning it first.)
    _wait(slurm, job, log, lambda t: max(_losses(t), default=0) > SAVE_INTERVAL)
    for pid in _python_processes(slurm, job):
        os.kill(pid, signal.SIGKILL)
    state = _wait(slurm, job, log)
    assert state["JobState"] == "FAILED", log.read_text()[-3000:]
    assert (tmp_path / "run" / "plan.json").read_text() == plan.read_text()

    # 2. requeued: resumes from the periodic checkpoint; then Slurm's SIGTERM (preemption
    # warning, as --signal sends before the time limit): saves after the step, exits 0.
    slurm.run("scontrol", "requeue", job)
    _wait(slurm, job, log, lambda t: len(_starts(t)) == 2
          and max(_losses(_starts(t)[1]), default=0) > SAVE_INTERVAL + 1)
    slurm.run("scancel", "--signal=TERM", job)
    state = _wait(slurm, job, log)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    stopped = re.search(r"received SIGTERM: exiting after iteration (\d+)", _starts(text)[1])
    assert stopped, text[-3000:]
    last = int(stopped[1])
    assert last < ITERS, "the job ended before the signal; nothing was preempted"

    # 3. requeued again: resumes from the iteration it saved at and finishes.
    slurm.run("scontrol", "requeue", job)
    _wait(slurm, job, log, lambda t: len(_starts(t)) == 3)
    state = _wait(slurm, job, log)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    first, second, third = _starts(text)
    periodic = max(int(i) for i in re.findall(r"saved checkpoint at iteration (\d+)", first))
    assert periodic < max(_losses(first)), "killed after the last iteration it saved at"
    assert "reusing" in second and "reusing" in third  # the plan it trained with
    for start, begin, end in ((first, 1, max(_losses(first))), (second, periodic + 1, last),
                              (third, last + 1, ITERS)):
        assert _losses(start) == {i: expected[i] for i in range(begin, end + 1)}, start[-3000:]


@pytest.mark.parametrize("case", ["no plan", "world size", "data path"])
def test_bad_input_fails_before_training_in_one_line(
        case: str, reference, slurm, tmp_path: Path) -> None:
    _, plan, reference_env = reference
    env = dict(reference_env, RUN_DIR=str(tmp_path / "run"), PLAN_FILE=str(plan))
    if case == "no plan":
        env["PLAN_FILE"] = str(tmp_path / "plan.json")
        expected = f"PLAN_FILE={tmp_path / 'plan.json'}: no such file"
    elif case == "world size":
        env["PLAN_FILE"] = str(REPO / "examples" / "plans" / "tiny-llama_tp2_pp2_uneven.json")
        expected = "is for 4 ranks; this allocation has 1 node(s) x GPUS_PER_NODE=2 = 2"
    else:
        env["DATA_PATH"] = str(tmp_path / "nowhere" / "corpus_text_document")
        expected = f"DATA_PATH={env['DATA_PATH']}: cannot read localhost: {env['DATA_PATH']}.bin"
    log = tmp_path / "job.log"
    state = _wait(slurm, _sbatch(slurm, "sbatch_train.sh", env, log), log)
    lines = [ln for ln in log.read_text().splitlines() if not START_LINE.match(ln)]
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0", lines
    assert len(lines) == 1 and lines[0].startswith("sbatch_train.sh: error: "), lines
    assert expected in lines[0], lines


def test_bad_flag_fails_in_launch_before_any_rank(reference, slurm, tmp_path: Path) -> None:
    """A misspelt pretrain_gpt.py flag: `megatron-ext launch` refuses it in one line on every
    node before torchrun starts a rank, and the job fails with its exit code 2."""
    _, plan, reference_env = reference
    env = dict(reference_env, RUN_DIR=str(tmp_path / "run"), PLAN_FILE=str(plan),
               EXTRA_ARGS=reference_env["EXTRA_ARGS"] + " --hiden-size 64")
    log = tmp_path / "job.log"
    state = _wait(slurm, _sbatch(slurm, "sbatch_train.sh", env, log), log)
    text = log.read_text()
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0", text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("megatron-ext launch: error: ")]
    assert len(errors) == 1 and "--hiden-size" in errors[0] and "--hidden-size" in errors[0], text
    assert "Traceback" not in text and not LOSS_LINE.search(text), text[-3000:]
    assert "starting torchrun" not in text, text[-3000:]
