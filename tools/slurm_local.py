#!/usr/bin/env python3
"""A one-node Slurm cluster on this machine, for trying examples/slurm/ by hand (the tests' own
fixture, tests/slurm_cluster.py, which has the details).

    sudo python tools/slurm_local.py /tmp/slurm      # installs slurm-wlm + munge if missing,
                                                     # starts munged, slurmctld, slurmd; prints
                                                     # the SLURM_CONF to export; Ctrl-C stops all
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.slurm_cluster import NODE, LocalSlurm, SlurmUnavailable  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="private directory for the cluster's files")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    cluster = LocalSlurm(root=args.root.resolve(), cpus=args.cpus)
    try:
        cluster.start()
    except (SlurmUnavailable, RuntimeError) as e:
        cluster.stop()
        print(f"slurm_local.py: error: {e}", file=sys.stderr)
        return 2
    print(f"Slurm is up ({args.cpus} CPUs on node {NODE}). In another shell:\n"
          f"  export SLURM_CONF={args.root.resolve()}/slurm.conf PATH=$PATH:/usr/sbin\n"
          "Ctrl-C here stops it.", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while all(proc.poll() is None for proc in cluster.procs.values()):
            time.sleep(1)
        print("slurm_local.py: error: a daemon exited; see the logs in "
              f"{args.root.resolve()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
