"""Checkpoint directories on disk: manifest verification, the tracker, and the rollback guard.

The directories here are built by hand with the file names megatron-core's torch_dist writer
uses (common.pt, metadata.json, .metadata, __R_0.distcp); tests/dist/test_checkpoint_ops.py
damages the files of a real 4-rank checkpoint the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.checkpoint_files import (
    MANIFEST_VERSION,
    TRACKER_FILE,
    check_no_rollback,
    find_damage,
    publish_tracker,
    resolve_load,
    write_manifest,
)


def _checkpoint(root: Path, iteration: int, *, manifest: bool = True) -> Path:
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "common.pt").write_bytes(b"common" * 50)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (d / ".metadata").write_bytes(b"meta" * 40)
    for rank in range(2):
        (d / f"__{rank}_0.distcp").write_bytes(bytes(range(256)) * (rank + 3))
    if manifest:
        write_manifest(d, iteration)
    publish_tracker(root, iteration)
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for iteration in (10, 20, 30):
        _checkpoint(tmp_path, iteration)
    return tmp_path


@pytest.mark.parametrize("name", ["common.pt", "metadata.json", ".metadata", "__1_0.distcp"])
@pytest.mark.parametrize("how", ["truncate", "empty", "flip", "delete"])
def test_damaged_file_is_named_with_the_newest_intact_checkpoint(root: Path, name: str,
                                                                 how: str) -> None:
    path = root / "iter_0000030" / name
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flip":  # same size, one byte changed: only the checksum sees it
        path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    else:
        path.unlink()
    with pytest.raises(PlanError) as err:
        resolve_load(root)
    message = str(err.value)
    assert "\n" not in message
    assert f"checkpoint iteration 30 is damaged ({name}" in message, message
    assert message.endswith("the newest intact one is iteration 20: add --ckpt-step 20 to "
                            "load it"), message
    assert resolve_load(root, ckpt_step=20).iteration == 20  # the named fix works


def test_damaged_manifest_and_no_intact_checkpoint_left(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path, 5)
    (d / "manifest.json").write_text('{"files": ')
    with pytest.raises(PlanError, match=r"manifest.json is not a readable manifest\); no intact "
                                        r"checkpoint is left under"):
        resolve_load(tmp_path)


@pytest.mark.parametrize("text", ["", "3x", "\x00\x00"])
def test_damaged_tracker_names_the_newest_intact_checkpoint(root: Path, text: str) -> None:
    (root / TRACKER_FILE).write_text(text)
    with pytest.raises(PlanError, match=rf"{TRACKER_FILE} is damaged .*the newest intact one is "
                                        r"iteration 30: add --ckpt-step 30"):
        resolve_load(root)
    assert resolve_load(root, ckpt_step=30).iteration == 30


def test_truncated_tracker_pointing_back_or_nowhere(root: Path) -> None:
    (root / TRACKER_FILE).write_text("3")  # "30" lost its last byte: no iter_0000003
    with pytest.raises(PlanError, match=r"names iteration 3, but iteration 30 is newer and intact"
                                        r".*--ckpt-step 30"):
        resolve_load(root)
    (root / TRACKER_FILE).write_text("20")  # older than an intact newer one: refused too
    with pytest.raises(PlanError, match=r"--ckpt-step 30, or --ckpt-step 20"):
        resolve_load(root)
    (root / TRACKER_FILE).write_text("40")
    with pytest.raises(PlanError, match=r"iteration 40 is damaged \(iter_0000040 does not exist\)"
                                        r".*--ckpt-step 30"):
        resolve_load(root)


def test_ckpt_step_loads_that_iteration_or_names_the_problem(root: Path) -> None:
    assert resolve_load(root).iteration == 30
    assert resolve_load(root, ckpt_step=10).directory == root / "iter_0000010"
    with pytest.raises(PlanError, match=r"--ckpt-step=15: .*iter_0000015 does not exist.*"
                                        r"--ckpt-step 30"):
        resolve_load(root, ckpt_step=15)


@pytest.mark.parametrize("ckpt_step", [None, 30])
def test_checkpoint_of_a_newer_schema_is_refused_by_name(root: Path, ckpt_step: int | None
                                                         ) -> None:
    manifest = root / "iter_0000030" / "manifest.json"
    record = json.loads(manifest.read_text())
    assert record["version"] == MANIFEST_VERSION
    record["version"] = MANIFEST_VERSION + 1
    record["files"] = {"layout-of-a-newer-release": {}}  # whatever a newer schema holds
    manifest.write_text(json.dumps(record))
    with pytest.raises(PlanError) as err:
        resolve_load(root, ckpt_step)
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        f"--load={root}: checkpoint iteration 30 was written with checkpoint schema version "
        f"{MANIFEST_VERSION + 1} (iter_0000030/manifest.json), newer than this megatron_ext "
        f"reads ({MANIFEST_VERSION}); load it with the megatron_ext release that wrote it (or a "
        "newer one)")
    assert resolve_load(root, ckpt_step=20).iteration == 20  # older ones still load


def test_checkpoints_without_a_manifest_get_the_basic_checks(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path, 7, manifest=False)  # written by Megatron-LM or older megatron_ext
    assert find_damage(d) is None
    (d / "metadata.json").write_text("")
    assert find_damage(d) == "metadata.json is empty"
    (d / "metadata.json").write_text("{")
    assert find_damage(d) == "metadata.json is not valid JSON"


def test_missing_or_empty_load_starts_from_scratch(tmp_path: Path) -> None:
    assert resolve_load(None) is None
    assert resolve_load(tmp_path / "missing") is None
    assert resolve_load(tmp_path) is None


def test_tracker_never_moves_back(root: Path) -> None:
    assert not publish_tracker(root, 20)
    assert (root / TRACKER_FILE).read_text() == "30"
    assert publish_tracker(root, 40)
    assert (root / TRACKER_FILE).read_text() == "40"
    # naming a damaged (here: missing) checkpoint, the tracker may be replaced by an older one
    assert publish_tracker(root, 30)
    assert (root / TRACKER_FILE).read_text() == "30"


def test_rollback_of_save_is_refused_before_launch(root: Path, tmp_path_factory) -> None:
    typo = tmp_path_factory.mktemp("elsewhere") / "chekpoints"
    with pytest.raises(PlanError, match=rf"--save={root} holds iteration 30, but this run starts "
                                        rf"from iteration 0 \(--load={typo} holds no checkpoint\)"
                                        rf".*pass --load {root} to resume it"):
        check_no_rollback(load=str(typo), save=str(root), target=resolve_load(typo),
                          finetune=False)
    with pytest.raises(PlanError, match=r"\(no --load is given\)"):
        check_no_rollback(load=None, save=str(root), target=None, finetune=False)
    older = resolve_load(root, ckpt_step=20)
    with pytest.raises(PlanError, match=r"starts from iteration 20 \(it loads iteration 20 .*drop "
                                        r"--ckpt-step"):
        check_no_rollback(load=str(root), save=str(root), target=older, finetune=False)
    # allowed: resuming the newest, --finetune, an empty --save
    check_no_rollback(load=str(root), save=str(root), target=resolve_load(root), finetune=False)
    check_no_rollback(load=str(typo), save=str(root), target=None, finetune=True)
    check_no_rollback(load=None, save=str(typo), target=None, finetune=False)


def test_damaged_newer_checkpoints_in_save_may_be_overwritten(root: Path) -> None:
    (root / "iter_0000030" / "common.pt").write_bytes(b"")
    check_no_rollback(load=str(root), save=str(root), target=resolve_load(root, ckpt_step=20),
                      finetune=False)
