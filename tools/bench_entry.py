"""How long a flag typo takes to report: pretrain_gpt.py alone and under torchrun (4 ranks).

    python tools/bench_entry.py [--repeats 3] [--json bench_entry.json]

Rows (median wall time of --repeats launches each, with the load average and the reference loop
of megatron_ext/calibration/load_check.py before and after, since on a shared machine
both move):
  typo, 1 process         python examples/pretrain_gpt.py --num-layerz 2
  typo, torchrun x4       torchrun --standalone --nproc_per_node 4 examples/pretrain_gpt.py ...
  torchrun x4, no-op      the same torchrun launching a script that exits 2 at once: torchrun's
                          own cost (its import of torch, the rendezvous, its failure report)
  import before parsing   python -c "import ...training.pretrain": what every rank paid before
                          the flags were parsed, when the entry point imported megatron-core first
The typo rows minus the no-op row is what pretrain_gpt.py itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_ext.calibration.load_check import LoadLog
from megatron_ext.warning_filters import install as install_warning_filters  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "examples" / "pretrain_gpt.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]


def _wall_s(cmd: list[str], repeats: int) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    times, code = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        code = subprocess.run(cmd, capture_output=True, check=False, env=env, cwd=REPO,
                              timeout=600).returncode
        times.append(time.perf_counter() - t0)
    return statistics.median(times), code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    load = LoadLog()
    load.checkpoint("start")
    with tempfile.TemporaryDirectory() as tmp:
        noop = Path(tmp) / "exit2.py"
        noop.write_text("import sys\nsys.exit(2)\n")
        cases = [
            ("typo, 1 process", [sys.executable, PRETRAIN, "--num-layerz", "2"]),
            ("typo, torchrun x4", [*TORCHRUN, PRETRAIN, "--num-layerz", "2"]),
            ("torchrun x4, no-op", [*TORCHRUN, str(noop)]),
            ("import before parsing",
             [sys.executable, "-c", "import megatron_ext.megatron_adapter.training.pretrain"]),
        ]
        rows = []
        for name, cmd in cases:
            wall_s, code = _wall_s(cmd, args.repeats)
            rows.append({"case": name, "median_wall_s": wall_s, "exit_code": code})
    load.checkpoint("end")
    print(f"{'case':<24}{'median s':>10}{'exit':>6}")
    for r in rows:
        print(f"{r['case']:<24}{r['median_wall_s']:>10.2f}{r['exit_code']:>6}")
    print(load.table())
    print(load.verdict("read them as an upper bound"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "repeats": args.repeats,
                                               "load": load.to_dict()}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
