"""A one-node Slurm cluster on this machine: the fixture of tests/dist/test_slurm_real.py, and what
`python tools/slurm_local.py DIR` starts for trying examples/slurm/ by hand.

Everything lives under the given directory: slurm.conf, the munge key and socket, the controller's
state, slurmd's spool, the daemons' logs and pid files; nothing system-wide is written except the
packages. The node is this machine's CPUs under the name `localhost` (address 127.0.0.1, ports
picked free), without cgroups (proctrack/linuxproc, task/none), so it runs inside containers.
Each daemon is this process's child and is stopped by its own pid. Needs root (the daemons run
as root, SlurmUser=root), as CI does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
NODE = "localhost"


class SlurmUnavailable(RuntimeError):
    """slurm-wlm / munge are not installed and cannot be (not root, no apt-get, no registry)."""


def install_packages() -> None:
    """apt-get install slurm-wlm and munge unless their programs are already on PATH."""
    if all(shutil.which(p, path=_sbin_path()) for p in (*DAEMONS, "sbatch")):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurm-wlm is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SlurmUnavailable("apt-get install slurm-wlm munge failed: "
                                   + (done.stderr.strip().splitlines() or ["?"])[-1])


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf(root: Path, cpus: int) -> str:
    return f"""\
ClusterName=local
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=1
MinJobAge=3600
KillWait=10
InactiveLimit=0
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=local Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalSlurm:
    """The running cluster: `env` is what a client (sbatch, squeue, ...) needs."""

    root: Path
    """The private directory of everything the cluster writes."""
    cpus: int
    """The node's CPUs (Slurm's resources; no GPUs)."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    """Daemon name -> its process (our child)."""

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"), PATH=_sbin_path())

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              check=check, timeout=60)

    def start(self, timeout_s: float = 60) -> LocalSlurm:
        install_packages()
        munge = self.root / "munge"
        for d in (munge, self.root / "state", self.root / "spool"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(munge, 0o700)
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        (self.root / "slurm.conf").write_text(_conf(self.root, self.cpus))
        conf = str(self.root / "slurm.conf")
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"])
        self._wait(lambda: (munge / "munge.socket").exists(), timeout_s, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", conf])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0,
                   timeout_s, "slurmctld answering scontrol ping")
        self._spawn("slurmd", ["slurmd", "-D", "-N", NODE, "-f", conf])
        self._wait(self._idle, timeout_s, f"node {NODE} idle")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _idle(self) -> bool:
        state = self.run("sinfo", "-h", "-n", NODE, "-o", "%t", check=False).stdout.strip()
        return state == "idle"

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for "
                                       f"{what}; see {self.root}/{name}.log / {name}.out")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}; see "
                                   f"the logs in {self.root}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Cancel every job, wait for them to leave the node, then stop the daemons (last
        started first), each by its pid: SIGTERM, SIGKILL after 15 s. Last, SIGKILL what is left
        of the jobs: processes whose environment names this cluster's slurm.conf (without
        cgroups, a process that left its step's process tree, such as the checkpoint writer of a
        killed rank, is not ended by slurmd)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--state=RUNNING", check=False)
            self.run("scancel", "--state=PENDING", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run(
                    "squeue", "-h", "-t", "RUNNING,COMPLETING", check=False).stdout.strip():
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in self.job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def job_processes(self, job: str | None = None) -> list[int]:
        """Pids of the processes started by this cluster's jobs (or by job `job`): their
        environment holds this cluster's SLURM_CONF (and SLURM_JOB_ID=job)."""
        conf = f"SLURM_CONF={self.root / 'slurm.conf'}".encode()
        want = None if job is None else f"SLURM_JOB_ID={job}".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if conf in environ and (want is None or want in environ):
                found.append(int(proc.name))
        return found
