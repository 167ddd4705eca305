"""examples/slurm/*.sh under stand-in `sbatch`/`srun`/`scontrol`, and the Dockerfile's steps.

tests/dist/test_slurm_real.py runs the scripts under a real one-node Slurm (no container, 2 CPU
ranks). What only stand-ins can show stays here: two nodes (the rendezvous at the first node of a
multi-node allocation), the pyxis container flags, and plans for 4 to 16 GPUs.

The stand-ins record their argv (one JSON list per call). `srun` runs `megatron-ext ...` commands
for real (search, args) and only records the others (the training launch, `megatron-ext launch`
behind `bash -c`, and the profiler's torchrun), so the test checks the
exact training command a cluster would get: rendezvous at the allocation's first node, container
flags, CUDA_DEVICE_MAX_CONNECTIONS chosen per feature, and plan flags that arrive intact and parse
with megatron_ext's Megatron-LM parser.
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = ("node-a", "node-b")
SRUN = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(["srun", *sys.argv[1:]]) + "\\n")
cmd = sys.argv[1:]
while cmd and cmd[0].startswith("-"):
    cmd = cmd[1:]
if cmd and cmd[0] == "megatron-ext":
    os.execvp(cmd[0], cmd)
"""
SCONTROL = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(["scontrol", *sys.argv[1:]]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join({list(NODES)!r}))
"""
SBATCH = f"""#!{sys.executable}
import json, os, subprocess, sys
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(["sbatch", *sys.argv[1:]]) + "\\n")
args, nodes = sys.argv[1:], "1"
while args[0].startswith("-"):
    if args[0] == "--nodes":
        nodes, args = args[1], args[2:]
    else:
        args = args[1:]
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=nodes,
           SLURM_JOB_NODELIST="node-[a-b]")
sys.exit(subprocess.call(["bash", *args], env=env))
"""


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("sbatch", SBATCH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, STANDIN_LOG=str(log), RUN_DIR=str(tmp_path / "run"),
               PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               IMAGE="registry/megatron-ext:test", MOUNTS="/data:/data")
    return env, log


def _sbatch(script: str, env: dict[str, str], log: Path) -> list[list[str]]:
    result = subprocess.run([str(Path(env["PATH"].split(":")[0]) / "sbatch"), "--nodes", "2",
                             str(REPO / "examples" / "slurm" / script)],
                            check=False, capture_output=True, text=True, timeout=300, env=env,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def _launch(calls: list[list[str]], via: tuple[str, ...] = ("megatron-ext", "launch")
            ) -> list[str]:
    """The one srun call that starts the ranks: through `megatron-ext launch` (training, which
    checks the run first) or `python -m torch.distributed.run` (the profiler)."""
    def has(call: list[str]) -> bool:
        return any(tuple(call[i:i + len(via)]) == via for i in range(len(call)))

    launches = [c for c in calls if c[0] == "srun" and has(c)]
    assert len(launches) == 1, calls
    assert not any("torch.distributed.run" in c for c in calls if c not in launches), calls
    return launches[0]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _check_launch_common(launch: list[str], ranks_per_node: int = 8) -> None:
    assert "--ntasks-per-node=1" in launch
    assert "--container-image=registry/megatron-ext:test" in launch
    assert "--container-mounts=/data:/data" in launch
    assert _after(launch, "--rdzv_endpoint") == f"{NODES[0]}:6000"
    assert _after(launch, "--nnodes") == "2"
    assert _after(launch, "--nproc_per_node") == str(ranks_per_node)


def test_train_script_searches_then_launches_the_plan(cluster: tuple[dict, Path]) -> None:
    env, log = cluster
    env.update(MODEL="tiny-llama", CLUSTER="dgx-h100", GLOBAL_BATCH_SIZE="64", SEQ_LENGTH="256")
    calls = _sbatch("sbatch_train.sh", env, log)
    assert ["scontrol", "show", "hostnames", "node-[a-b]"] in calls
    search = next(c for c in calls if c[0] == "srun" and "search" in c)
    assert _after(search, "--nodes") == "2" and _after(search, "--model") == "tiny-llama"
    plan = Path(_after(search, "--out"))
    emitted = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "args", str(plan)],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    launch = _launch(calls)
    _check_launch_common(launch)
    script_args = launch[launch.index("examples/pretrain_gpt.py") + 1:]
    assert script_args[:len(emitted)] == emitted
    from megatron_ext.flags.parser import parse_megatron_args

    parse_megatron_args(script_args, world_size=16)  # raises a PlanError if anything is off


@pytest.mark.parametrize(("plan", "token", "connections"), [
    ("gpt3-1.3b_tp2_pp4_layout.json", "Et*5|t*6|t*7|t*6L", "1"),  # TP=2; a layout string
    ("llama3-8b_ulysses4_cp2_zero3.json", "--use-torch-fsdp2", None),  # FSDP2 forbids 1
    ("tiny-llama_tp2_pp2_vocab_parallel.json", "--vocab-parallel", "8"),
    ("llama2-7b_hetero_pp2.json", "--strategy-config", "1"),
])
def test_train_script_sets_connections_per_feature(
        cluster: tuple[dict, Path], plan: str, token: str, connections: str | None) -> None:
    env, log = cluster
    env["PLAN_FILE"] = str(REPO / "examples" / "plans" / plan)
    per_node = json.loads(Path(env["PLAN_FILE"]).read_text())["world_size"] // 2
    env["GPUS_PER_NODE"] = str(per_node)  # the script refuses a plan for another world size
    calls = _sbatch("sbatch_train.sh", env, log)
    assert not any("search" in c for c in calls)  # an existing plan skips the search
    launch = _launch(calls)
    _check_launch_common(launch, per_node)
    assert token in launch  # survived mapfile and srun intact: no word splitting, no globbing
    export = next(a for a in launch if a.startswith("--export="))
    expected = "ALL" if connections is None else f"ALL,CUDA_DEVICE_MAX_CONNECTIONS={connections}"
    assert export == f"--export={expected}"


def test_profile_script_runs_the_hardware_profiler(cluster: tuple[dict, Path]) -> None:
    env, log = cluster
    launch = _launch(_sbatch("sbatch_profile.sh", env, log), via=("-m", "torch.distributed.run"))
    _check_launch_common(launch)
    tail = launch[launch.index("-m", launch.index("torch.distributed.run")):]
    assert tail[:4] == ["-m", "megatron_ext.cli", "profile", "hardware"]
    assert _after(launch, "--out") == f"{env['RUN_DIR']}/cluster_profile.json"
    assert "--export=ALL,CUDA_DEVICE_MAX_CONNECTIONS=1" in launch


def test_dockerfile_runs_only_the_ci_exercised_steps() -> None:
    lines = [ln.strip() for ln in (REPO / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    base = next(ln for ln in lines if ln.startswith("FROM "))
    assert base.startswith("FROM nvcr.io/nvidia/pytorch:") and not base.endswith(":latest")
    assert [ln for ln in lines if ln.startswith("RUN ")] == [
        "RUN bash tools/docker_steps.sh /opt/megatron_ext"]


def test_docker_steps_run_here(tmp_path: Path) -> None:
    """The image's install steps, in order, on this machine, into a virtual environment of its
    own that sees this one's packages (a .pth line): megatron-core is asked for at the version
    installed here, so pip only re-checks it and links this checkout into the new environment.
    The environment running the tests keeps its own megatron-core and megatron_ext, on either CI
    leg (the image's default, 0.19.x, has no wheel for the first leg's Python 3.11)."""
    installed = metadata.version("megatron-core")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    inner_site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", purelib],
        check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    (Path(inner_site) / "outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    result = subprocess.run(["bash", str(REPO / "tools" / "docker_steps.sh"), str(REPO)],
                            check=False, capture_output=True, text=True, timeout=900,
                            env=dict(os.environ, PYTHON=str(venv / "bin" / "python"),
                                     MEGATRON_CORE=f"megatron-core=={installed}"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # megatron.core.__version__ of 0.19 appends the git commit of the working directory
    assert re.search(rf"^megatron-core {re.escape(installed)}(\+\w+)?$", result.stdout, re.M)
    assert "docker_steps: OK" in result.stdout
    assert metadata.version("megatron-core") == installed  # nothing changed out here


def test_image_and_second_ci_leg_install_the_same_megatron_core() -> None:
    """tools/docker_steps.sh's default requirement is the one .ci/run pins for its Python 3.12
    leg, so the leg tests what the image installs."""
    steps = (REPO / "tools" / "docker_steps.sh").read_text()
    ci = (REPO / ".ci" / "leg2").read_text()
    default = steps.split("MEGATRON_CORE=${MEGATRON_CORE:-", 1)[1].split("}", 1)[0]
    assert default == "megatron-core>=0.19,<0.20"
    assert f'LEG2_MEGATRON_CORE="{default}"' in ci
