"""`megatron-ext checkpoint inspect DIR`: what a checkpoint holds, without a process group
(and `export-hf DIR OUT`, checkpoint_export.py).

DIR is a `--save`/`--load` directory (its tracker names the iteration) or one `iter_NNNNNNN`
directory. Printed: the iteration, the plan it was saved under, the megatron-core version that
wrote it, its size, whether it is intact against its manifest, and whether (and in which
layout) it holds optimizer state. torch is imported only here, when the command runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from megatron_ext.errors import PlanError

_ITER = re.compile(r"iter_(\d{7,})$")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect a checkpoint directory")
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=type(p))
    inspect = verbs.add_parser("inspect", help="iteration, plan, sizes, integrity and optimizer "
                               "state of a checkpoint (no process group)")
    inspect.add_argument("dir", help="a --save directory or one iter_NNNNNNN directory in it")
    inspect.add_argument("--json", action="store_true", help="print the record as JSON")
    inspect.set_defaults(run=run_inspect)
    export = verbs.add_parser("export-hf", help="write a dense Llama-family checkpoint as a "
                              "HuggingFace model (model.safetensors + config.json)")
    export.add_argument("dir", help="a --save directory or one iter_NNNNNNN directory in it")
    export.add_argument("out", help="output directory")
    export.set_defaults(run=run_export)


def _locate(path: Path) -> tuple[Path, int, int | None]:
    """(iteration directory, iteration, the tracker's iteration or None)."""
    from megatron_ext.megatron_adapter.training.checkpoint_files import (
        TRACKER_FILE,
        iteration_dir,
        read_tracker,
    )

    if not path.is_dir():
        raise PlanError(f"checkpoint inspect: {path} is not a directory; pass a --save "
                        "directory or one of its iter_NNNNNNN directories")
    match = _ITER.match(path.name)
    if match:
        return path, int(match.group(1)), read_tracker(path.parent)
    tracker = read_tracker(path)
    if tracker is None:
        raise PlanError(f"checkpoint inspect: {path} has no {TRACKER_FILE} and is not an "
                        "iter_NNNNNNN directory; pass the directory --save wrote")
    return iteration_dir(path, tracker), tracker, tracker


def _common(ckpt: Path) -> dict[str, Any]:
    from megatron_ext.megatron_adapter.compat import load_common_state
    from megatron_ext.megatron_adapter.training.checkpoint_files import find_damage

    if not (ckpt / "common.pt").is_file() and find_damage(ckpt) == "common.pt is missing":
        raise PlanError(f"checkpoint inspect: {ckpt} has no common.pt; the directory is not a "
                        "complete dist_checkpointing checkpoint")
    try:  # common.pt, or (megatron-core 0.19+) the common state inside the torch_dist files
        return load_common_state(ckpt)
    except Exception as err:  # a foreign or truncated file
        where = ckpt / "common.pt" if (ckpt / "common.pt").is_file() else ckpt
        raise PlanError(f"checkpoint inspect: {where} cannot be read "
                        f"({type(err).__name__}); the directory is not a complete "
                        "dist_checkpointing checkpoint") from None


def _tensor_keys(ckpt: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception:  # damaged: reported by the integrity check
        return []
    # megatron-core 0.19+ stores the common state as one more object (read by _common)
    return [k for k in keys if not k.startswith("common_state")]


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """The record `checkpoint inspect` prints."""
    from megatron_ext.megatron_adapter.training.checkpoint_files import find_damage

    ckpt, iteration, tracker = _locate(Path(path))
    files = [f for f in ckpt.rglob("*") if f.is_file()] if ckpt.is_dir() else []
    damage = find_damage(ckpt)
    record: dict[str, Any] = {
        "directory": str(ckpt), "iteration": iteration, "tracker_iteration": tracker,
        "bytes": sum(f.stat().st_size for f in files), "files": len(files),
        "intact": damage is None, "damage": damage,
        "manifest": (ckpt / "manifest.json").is_file()}
    try:
        common = _common(ckpt)
    except PlanError:
        if damage is not None:  # reported as the damage
            return record
        raise
    ext = common.get("megatron_ext") or {}
    plan = json.loads(ext["plan"]) if "plan" in ext else None
    keys = _tensor_keys(ckpt)
    optim_keys = [k for k in keys if k.startswith("optimizer.")]
    optimizer = common.get("optimizer")
    record.update({
        "megatron_core_version": ext.get("megatron_core_version"),
        "written_by": "megatron_ext" if ext else "Megatron-LM (no megatron_ext record)",
        "checkpoint_version": common.get("checkpoint_version"),
        "train_state": common.get("train_state"),
        "plan": plan, "padded_vocab_size": ext.get("padded_vocab_size"),
        "model_tensors": len(keys) - len(optim_keys),
        "optimizer_state": optimizer is not None,
        "optimizer_layout": (ext.get("optimizer_layout") or "megatron-core chained")
        if optimizer is not None else None,
        "optimizer_step": optimizer.get("step") if isinstance(optimizer, dict) else None,
        "optimizer_tensors": {name: sum(1 for k in optim_keys if k.startswith(
            f"optimizer.state.{name}.")) for name in sorted({k.split(".")[2] for k in optim_keys
                                                            if k.count(".") > 2})}})
    return record


def _summary(record: dict[str, Any]) -> str:
    lines = [f"{record['directory']}: iteration {record['iteration']}"
             + ("" if record["tracker_iteration"] in (None, record["iteration"]) else
                f" (the tracker names {record['tracker_iteration']})"),
             f"  size: {record['bytes'] / 2**20:.1f} MiB in {record['files']} files",
             "  integrity: " + ("intact" + (" (checked against manifest.json)" if
                                           record["manifest"] else " (no manifest: checked "
                                           "common.pt and metadata only)")
                                if record["intact"] else f"DAMAGED: {record['damage']}")]
    if "written_by" not in record:
        return "\n".join(lines) + "\n"
    plan = record["plan"]
    lines.append(f"  written by: {record['written_by']}, megatron-core "
                 f"{record['megatron_core_version'] or 'version not recorded'}")
    if plan is not None:
        model = plan["model"]
        lines.append(f"  plan: {model.get('name')} on {plan['world_size']} ranks, "
                     f"pp={plan['pp']}, vocabulary {plan.get('vocab', {}).get('mode', 'tp')} "
                     f"(padded to {record['padded_vocab_size']})")
    state = record["train_state"] or {}
    if state:
        lines.append(f"  consumed samples: {state.get('consumed_train_samples')}, skipped "
                     f"iterations: {state.get('skipped_iterations')}")
    if record["optimizer_state"]:
        tensors = ", ".join(f"{n} x{c}" for n, c in record["optimizer_tensors"].items())
        lines.append(f"  optimizer state: yes ({record['optimizer_layout']} layout, step "
                     f"{record['optimizer_step']}; {tensors or 'no tensors'})")
    else:
        lines.append("  optimizer state: none (saved with --no-save-optim): load it with "
                     "--no-load-optim or --finetune")
    lines.append(f"  model tensors: {record['model_tensors']}")
    return "\n".join(lines) + "\n"


def run_inspect(args: argparse.Namespace) -> int:
    record = inspect_checkpoint(args.dir)
    if args.json:
        sys.stdout.write(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(_summary(record))
    return 0 if record["intact"] else 1


def run_export(args: argparse.Namespace) -> int:
    from megatron_ext.commands.checkpoint_export import export_hf

    ckpt, _, _ = _locate(Path(args.dir))
    sys.stderr.write(f"wrote {export_hf(ckpt, _common(ckpt), args.out)}\n")
    return 0
