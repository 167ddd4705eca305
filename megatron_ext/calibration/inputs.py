"""Every row a benchmark run scores: the published-runs file plus vTrain's and Lucie-7B's
measured runs, each CSV copy checked against its upstream blob when it is the repository's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ext.calibration import lucie, vtrain
from megatron_ext.calibration.sources import DEFAULT_DATA, load_published
from megatron_ext.errors import PlanError


def benchmark_rows(data: str | Path = DEFAULT_DATA, *, with_vtrain: bool = True,
                   with_lucie: bool = True, vtrain_dir: str | Path | None = None,
                   lucie_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The published rows, then vTrain's and Lucie's (from the repository's copies unless a
    directory is given). A PlanError names a repository copy that differs from upstream."""
    rows = load_published(data)
    sources = (
        (with_vtrain, vtrain_dir, vtrain.VTRAIN_DIR, vtrain.check_vtrain_files, vtrain.vtrain_rows,
         f"the upstream files ({vtrain.VTRAIN_REPO} @ {vtrain.VTRAIN_COMMIT[:12]})"),
        (with_lucie, lucie_dir, lucie.LUCIE_DIR, lucie.check_lucie_files, lucie.lucie_rows,
         f"the upstream file ({lucie.LUCIE_REPO} {lucie.LUCIE_PATH} @ "
         f"{lucie.LUCIE_COMMIT[:12]})"),
    )
    for wanted, directory, shipped, check, load, upstream in sources:
        if not wanted:
            continue
        directory = Path(directory or shipped)
        damaged = directory.resolve() == shipped and check()
        if damaged:
            raise PlanError(f"{shipped}: {', '.join(damaged)} differ from {upstream}; fix: "
                            "restore them (README.md there)")
        rows = rows + load(directory)
    return rows
