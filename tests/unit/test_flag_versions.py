"""Megatron-LM flags per version: core_v0.19.0's catalog beside core_v0.16.1's (flags/versions.py).

`args --megatron-version 0.19` prints only flags core_v0.19.0 has (over the search suite's plans
and the example plans), `plan-from-args` reads either version's flags into the same plan, a flag
one version lacks is refused in one line naming the version and the replacement, and honoured
flags keep each version's own dest and default.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.errors import PlanError
from megatron_ext.flags import versions
from megatron_ext.flags.catalog import megatron_flags, option_sets
from megatron_ext.flags.emit import MEGATRON_EXT_FLAGS, plan_to_megatron_args
from megatron_ext.flags.parser import (
    build_megatron_parser,
    flag_catalog,
    parse_megatron_args,
    plan_from_megatron_args,
)
from megatron_ext.flags.table import EMIT_TABLE
from megatron_ext.flags.versions import BASE, CATALOGS, RENAMED, resolve
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.search import search
from megatron_ext.planner.suite import MOE_SUITE, SUITE
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset
from tests.doc_excerpts import README_PLAN_FLAGS

ROOT = Path(__file__).resolve().parents[2]
V019 = resolve("0.19")
# The search suite's cases (tools/bench_search.py) that search in a few seconds here; the others
# (up to 40 s each) print from the same EMIT_TABLE, checked flag by flag below.
FAST_CASES = ("llama2-7b@8@24GiB", "llama3-8b@8@24GiB", "mixtral-8x7b@64", "qwen2-57b-a14b@128")
README_FLAGS = README_PLAN_FLAGS.split()


def _megatron_tokens(argv: tuple[str, ...]) -> set[str]:
    return {t for t in argv if t.startswith("--") and t not in MEGATRON_EXT_FLAGS}


def test_catalogs_are_the_generated_files_of_their_tags() -> None:
    for entry in CATALOGS:
        data = json.loads(entry.file.read_text())
        assert data["about"].startswith(f"Every option string of Megatron-LM {entry.tag} ")
    assert len(megatron_flags(BASE)) == 682 and len(megatron_flags(V019)) == 847


def test_every_flag_args_can_print_is_the_same_flag_in_every_catalog() -> None:
    """Same dest and default: `args` leaves out defaults, so that is right for both versions."""
    megatron = [flag for _, _, flag, _ in EMIT_TABLE if flag not in MEGATRON_EXT_FLAGS]
    assert len(megatron) > 40
    for flag in megatron:
        specs = {(megatron_flags(c)[flag].dest, megatron_flags(c)[flag].default)
                 for c in CATALOGS}
        assert len(specs) == 1, (flag, specs)


@pytest.mark.parametrize("key", FAST_CASES)
def test_search_suite_plans_emit_only_core_v0_19_flags(key: str, tmp_path: Path) -> None:
    case = next(c for c in (*SUITE, *MOE_SUITE) if c.key == key)
    cluster = cluster_preset(case.cluster, num_nodes=case.nodes, memory_gib=case.memory_gib)
    training = TrainingSpec(global_batch_size=case.global_batch_size,
                            seq_length=case.seq_length)
    result = search(CostModel(model_preset(case.model), cluster, training))
    plans = [p for p in (result.plan, result.uniform_plan) if p is not None]
    assert len(plans) == 2
    for plan in plans:
        path = tmp_path / "plan.json"
        plan.save(path)
        argv = plan_to_megatron_args(plan, plan_path=str(path), megatron_version="0.19").argv
        assert _megatron_tokens(argv) <= option_sets()[V019.version], key
        assert argv == plan_to_megatron_args(plan, plan_path=str(path),
                                             megatron_version="0.16.1").argv


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "plans").glob("*.json")),
                         ids=lambda p: p.name)
def test_example_plans_emit_only_core_v0_19_flags(path: Path) -> None:
    out = plan_to_megatron_args(ParallelPlan.load(path), plan_path=str(path),
                                megatron_version="0.19.2")
    assert _megatron_tokens(out.argv) <= option_sets()[V019.version]


@pytest.mark.parametrize("version", ["0.16.1", "0.19"])
def test_plan_from_args_reads_either_versions_flags(version: str) -> None:
    ns = parse_megatron_args(README_FLAGS, world_size=16, megatron_version=version)
    plan = plan_from_megatron_args(ns, 16)
    reference = plan_from_megatron_args(parse_megatron_args(README_FLAGS, world_size=16,
                                                            megatron_version="0.16.1"), 16)
    assert plan.to_dict() == reference.to_dict()


def test_a_flag_gone_in_0_19_names_the_version_and_the_replacement() -> None:
    with pytest.raises(PlanError) as err:
        parse_megatron_args([*README_FLAGS, "--muon-use-nesterov"], world_size=16,
                            megatron_version="0.19")
    assert str(err.value) == ("--muon-use-nesterov is not a Megatron-LM core_v0.19.0 flag (gone "
                              "since core_v0.19.0): use --muon-nesterov (the same switch, "
                              "renamed)")
    with pytest.raises(PlanError, match=r"^--no-async-tensor-model-parallel-allreduce is not a "
                       r"Megatron-LM core_v0.19.0 flag .*drop it$"):
        parse_megatron_args([*README_FLAGS, "--no-async-tensor-model-parallel-allreduce"],
                            world_size=16, megatron_version="0.19")
    # the same flag is fine for 0.16.1, where it exists
    parse_megatron_args([*README_FLAGS, "--muon-use-nesterov"], world_size=16,
                        megatron_version="0.16.1")


def test_a_0_19_flag_given_for_0_16_names_the_old_spelling_or_the_version() -> None:
    with pytest.raises(PlanError, match=r"^--muon-nesterov is a Megatron-LM core_v0.19.0 flag; "
                       r"core_v0.16.1 spells it --muon-use-nesterov"):
        parse_megatron_args([*README_FLAGS, "--muon-nesterov"], world_size=16,
                            megatron_version="0.16.1")
    with pytest.raises(PlanError, match=r"^--moe-paged-stash is a Megatron-LM flag of "
                       r"core_v0.19.0, not of core_v0.16.1; drop it, or pass --megatron-version"):
        parse_megatron_args([*README_FLAGS, "--moe-paged-stash"], world_size=16,
                            megatron_version="0.16.1")


def test_renamed_table_matches_the_catalogs() -> None:
    """Every core_v0.16.1 flag core_v0.19.0 lacks has a line; every replacement exists there."""
    base, newer = option_sets()[BASE.version], option_sets()[V019.version]
    assert {r.option for r in RENAMED} == base - newer
    for r in RENAMED:
        assert not r.replacement or r.replacement in newer, r


def test_unclassified_0_19_flags_are_refused_unless_default_never_ignored() -> None:
    table = flag_catalog(V019)
    new = set(table) - option_sets()[BASE.version]
    assert new and all(table[o].kind != "honoured" for o in new)
    with pytest.raises(PlanError, match=r"^--moe-paged-stash: this core_v0.19.0 feature is not "
                       "supported by megatron_ext"):
        parse_megatron_args([*README_FLAGS, "--moe-paged-stash"], world_size=16,
                            megatron_version="0.19")
    ns = parse_megatron_args([*README_FLAGS, "--pytorch-profiler-collect-shapes"],
                             world_size=16, megatron_version="0.19")
    assert any(n.startswith("--pytorch-profiler-collect-shapes has no effect here")
               for n in ns.no_effect_notes)


def _default(text: str) -> str:
    enum = re.fullmatch(r"<\w+\.(\w+): .*>", text)
    return repr(enum.group(1)) if enum else text


def test_honoured_flags_have_core_v0_19_dest_and_default() -> None:
    """--data-parallel-sharding-strategy: optim_grads_params in core_v0.19.0, no_shard before."""
    actions = {o: a for a in build_megatron_parser(version=V019)._actions
               for o in a.option_strings}
    for option, entry in flag_catalog(V019).items():
        if entry.kind == "honoured":
            assert actions[option].dest == entry.flag.dest, option
            assert repr(actions[option].default) == _default(entry.flag.default), option
    assert actions["--data-parallel-sharding-strategy"].default == "optim_grads_params"
    assert parse_megatron_args(README_FLAGS, world_size=16, megatron_version="0.16.1"
                               ).data_parallel_sharding_strategy == "no_shard"


def test_default_version_is_the_installed_one_else_the_newest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: "0.19.2")
    assert resolve(None) == V019
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: None)
    assert resolve(None) == CATALOGS[-1]
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: "0.18.0")
    with pytest.raises(PlanError, match=r"^the installed megatron-core=0.18.0 has no Megatron-LM "
                       r"flag catalog here; use --megatron-version with one of 0.16.1, 0.19.0$"):
        resolve(None)


def test_cli_version_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["flags", "--megatron-version", "0.19"]) == 0
    assert capsys.readouterr().out.startswith("847 Megatron-LM core_v0.19.0 flags: ")
    assert cli_main(["flags", "--megatron-version", "0.19", "muon-use-nesterov"]) == 2
    assert "use --muon-nesterov" in capsys.readouterr().err
    plan = str(ROOT / "examples" / "plans" / "llama2-7b_uniform_tp2_pp2.json")
    assert cli_main(["args", "--megatron-version", "0.19.2", plan]) == 0
    assert "--tensor-model-parallel-size\n2\n" in capsys.readouterr().out
    assert cli_main(["args", "--megatron-version", "0.17", plan]) == 2
    assert capsys.readouterr().err == (
        "megatron-ext: error: --megatron-version=0.17 has no Megatron-LM flag catalog here; use "
        "--megatron-version with one of 0.16.1, 0.19.0\n")
    out = tmp_path / "mine.json"
    assert cli_main(["plan-from-args", "--megatron-version", "0.19", "--world-size", "16",
                     "--out", str(out), "--", *README_FLAGS]) == 0
    assert ParallelPlan.load(out).world_size == 16
