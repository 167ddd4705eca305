"""The files of a checkpoint directory: tracker, manifest, verification, and rollback guard.

Pure file operations (no torch, no process group), so every check here runs before any group
exists and ends in one PlanError line.

- `latest_checkpointed_iteration.txt` (Megatron-LM's tracker) names the newest complete save.
  A save never rewrites it to an older iteration (`publish_tracker`).
- `iter_0000030/manifest.json` is written last by a save, after every rank's shards: each
  file's size, and a SHA-256 of the files up to `CHECKSUM_LIMIT` bytes (common.pt,
  metadata.json, .metadata and, for small models, the .distcp shards). `find_damage` checks
  it when loading; a damaged checkpoint is named together with the newest intact one and the
  flag that loads it (`--ckpt-step`, Megatron-LM's). Its `version` is the schema: a checkpoint
  written under a newer one is refused by name (`newer_schema`) rather than misread.
- `check_no_rollback`: a run whose saves would move `--save` back (a typo in `--load`, no
  `--load`, an older `--ckpt-step`) is refused before it starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.errors import PlanError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
CHECKSUM_LIMIT = 64 << 20
"""Files up to this size get a SHA-256 in the manifest (a few ms per MiB); larger ones (the
weight shards of a real model) are checked by size only."""
_ITER_DIR = re.compile(r"iter_(\d{7,})")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(ckpt_dir: str | Path, iteration: int) -> None:
    """Record every file under `ckpt_dir` (call once all ranks have written theirs)."""
    ckpt_dir = Path(ckpt_dir)
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        name = path.relative_to(ckpt_dir).as_posix()
        if name in (MANIFEST_FILE, MANIFEST_FILE + ".tmp"):
            continue
        size = path.stat().st_size
        entry: dict[str, int | str] = {"size": size}
        if size <= CHECKSUM_LIMIT:
            entry["sha256"] = _sha256(path)
        files[name] = entry
    tmp = ckpt_dir / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": MANIFEST_VERSION, "iteration": iteration, "files": files}, f,
                  indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST_FILE)


def newer_schema(ckpt_dir: str | Path) -> int | None:
    """The manifest's schema version when it is newer than this code reads (`MANIFEST_VERSION`),
    else None (also when there is no readable manifest: `find_damage` reports that)."""
    try:
        version = json.loads((Path(ckpt_dir) / MANIFEST_FILE).read_text())["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, int) and version > MANIFEST_VERSION else None


def _check_schema(root: Path, iteration: int) -> None:
    version = newer_schema(iteration_dir(root, iteration))
    if version is not None:
        raise PlanError(
            f"--load={root}: checkpoint iteration {iteration} was written with checkpoint schema "
            f"version {version} ({iteration_dir(root, iteration).name}/{MANIFEST_FILE}), newer "
            f"than this megatron_ext reads ({MANIFEST_VERSION}); load it with the megatron_ext "
            "release that wrote it (or a newer one)")


def find_damage(ckpt_dir: str | Path) -> str | None:
    """What is wrong with a checkpoint directory (a few words naming the file), or None.

    Directories without a manifest (written by Megatron-LM or an older megatron_ext) get the
    checks that need none: common.pt (megatron-core 0.19+: the common state inside the torch_dist
    files instead) and the two metadata files present, non-empty, and the JSON ones parse.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return f"{ckpt_dir.name} does not exist"
    manifest_path = ckpt_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        return _damage_without_manifest(ckpt_dir)
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{MANIFEST_FILE} is not a readable manifest"
    for name, entry in sorted(files.items()):
        path = ckpt_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
    for name, entry in sorted(files.items()):  # sizes first: they are cheap
        if "sha256" in entry and _sha256(ckpt_dir / name) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _damage_without_manifest(ckpt_dir: Path) -> str | None:
    for name in ("common.pt", "metadata.json", ".metadata"):
        path = ckpt_dir / name
        if not path.is_file():
            if name == "common.pt" and _common_state_inside(ckpt_dir):
                continue
            return f"{name} is missing"
        if path.stat().st_size == 0:
            return f"{name} is empty"
    try:
        json.loads((ckpt_dir / "metadata.json").read_text())
    except ValueError:
        return "metadata.json is not valid JSON"
    return None


def _common_state_inside(ckpt_dir: Path) -> bool:
    """megatron-core 0.19+ writes no common.pt: the common state is the torch_dist object
    `common_state`, whose key the pickled `.metadata` names."""
    metadata = ckpt_dir / ".metadata"
    return metadata.is_file() and b"common_state" in metadata.read_bytes()


def saved_iterations(root: str | Path) -> list[int]:
    """Iterations with a published directory under `root` (not `.tmp` ones), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [int(m[1]) for p in root.iterdir() if p.is_dir() and (m := _ITER_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def newest_intact(root: str | Path, *, below: int | None = None,
                  above: int | None = None) -> int | None:
    """The newest iteration under `root` (strictly between `above` and `below` when given)
    whose directory passes `find_damage`."""
    for iteration in saved_iterations(root):
        if below is not None and iteration >= below:
            continue
        if above is not None and iteration <= above:
            break
        if find_damage(iteration_dir(root, iteration)) is None:
            return iteration
    return None


def _intact_hint(root: str | Path, *, below: int | None = None) -> str:
    intact = newest_intact(root, below=below)
    if intact is None:
        return f"no intact checkpoint is left under {root}"
    return f"the newest intact one is iteration {intact}: add --ckpt-step {intact} to load it"


def read_tracker(root: str | Path) -> int | None:
    """The iteration `root`'s tracker file names, None when there is no tracker; a damaged
    tracker is a PlanError naming the newest intact checkpoint."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise PlanError(f"--load={root}: {TRACKER_FILE} is damaged (it holds {text[:20]!r}, not "
                        f"an iteration number); {_intact_hint(root)}")
    return int(text)


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """The checkpoint a run loads: `iteration` under `root`."""

    root: Path
    iteration: int

    @property
    def directory(self) -> Path:
        return iteration_dir(self.root, self.iteration)


def resolve_load(root: str | Path | None, ckpt_step: int | None = None) -> LoadTarget | None:
    """Which checkpoint `--load root [--ckpt-step N]` loads, verified; None when `root` holds
    none (the run starts from scratch). Every problem is one PlanError line."""
    if not root:
        return None
    root = Path(root)
    if ckpt_step is not None:
        if ckpt_step < 0:
            raise PlanError(f"--ckpt-step={ckpt_step}: an iteration number is >= 0")
        _check_schema(root, ckpt_step)
        damage = find_damage(iteration_dir(root, ckpt_step))
        if damage is not None:
            raise PlanError(f"--load={root} --ckpt-step={ckpt_step}: checkpoint iteration "
                            f"{ckpt_step} cannot be loaded ({damage}); {_intact_hint(root)}")
        return LoadTarget(root, ckpt_step)
    iteration = read_tracker(root)
    if iteration is None:
        if saved_iterations(root):
            raise PlanError(f"--load={root} has checkpoint directories but no {TRACKER_FILE}; "
                            f"{_intact_hint(root)}")
        return None
    newer = newest_intact(root, above=iteration)
    if newer is not None:
        raise PlanError(f"--load={root}: {TRACKER_FILE} names iteration {iteration}, but "
                        f"iteration {newer} is newer and intact (saves never move the tracker "
                        f"back); add --ckpt-step {newer}, or --ckpt-step {iteration} to load the "
                        "older one")
    _check_schema(root, iteration)
    damage = find_damage(iteration_dir(root, iteration))
    if damage is not None:
        raise PlanError(f"--load={root}: checkpoint iteration {iteration} is damaged ({damage}); "
                        f"{_intact_hint(root, below=iteration)}")
    return LoadTarget(root, iteration)


def check_no_rollback(*, load: str | None, save: str | None, target: LoadTarget | None,
                      finetune: bool) -> None:
    """One PlanError line when this run would save iterations older than `--save` holds.

    A run starts from the loaded iteration (0 without a checkpoint, or with --finetune); if
    `--save` already holds a newer one, its saves would overwrite newer checkpoints and the
    next resume would load the older state. --finetune is exempt (it starts a new run from
    loaded weights on purpose; the tracker still never moves back, see `publish_tracker`).
    """
    if not save or finetune:
        return
    start = target.iteration if target is not None else 0
    newest = newest_intact(save, above=start)  # damaged newer ones may be overwritten
    if newest is None:
        return
    if target is not None:
        why = f"it loads iteration {start} from --load={load}"
    elif load:
        why = f"--load={load} holds no checkpoint"
    else:
        why = "no --load is given"
    same = load and Path(load).resolve() == Path(save).resolve()
    fix = ("drop --ckpt-step to resume the newest" if same
           else f"pass --load {save} to resume it")
    raise PlanError(f"--save={save} holds iteration {newest}, but this run starts from "
                    f"iteration {start} ({why}) and would roll that directory back; {fix}, or "
                    "give the run a --save directory of its own (or pass --finetune to start "
                    "over on purpose)")


def publish_tracker(root: str | Path, iteration: int) -> bool:
    """Point `root`'s tracker at `iteration` atomically, unless it names a newer intact
    checkpoint already (then it is left alone and False returned: the tracker never moves
    back; a damaged tracker, or one naming a damaged checkpoint, is replaced)."""
    root = Path(root)
    try:
        current = read_tracker(root)
    except PlanError:
        current = None
    if current is not None and current > iteration and find_damage(
            iteration_dir(root, current)) is None:
        return False
    tmp = root / (TRACKER_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER_FILE)
    return True


def check_checkpoints(args: Any) -> LoadTarget | None:
    """The verified checkpoint `--load [--ckpt-step]` names (None: start from scratch), after
    refusing a rollback of `--save` and honouring --exit-on-missing-checkpoint; file checks
    only, run on every rank before torch is imported."""
    load = args.load
    target = resolve_load(load, args.ckpt_step)
    check_no_rollback(load=load, save=args.save, target=target, finetune=bool(args.finetune))
    if target is None and load and args.exit_on_missing_checkpoint:
        raise PlanError(f"--load={load} holds no checkpoint (--exit-on-missing-checkpoint)")
    return target
