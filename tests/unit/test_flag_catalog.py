"""The flag table (flags/catalog.py) against Megatron-LM core_v0.16.1's own parser listing.

megatron_ext/flags/megatron_lm_core_v0.16.1_flags.json lists every option of Megatron-LM's
`megatron/training/arguments.py` with its dest and default. Every option must have exactly one
class; every honoured option must be parsed with Megatron-LM's dest and default; no Megatron-LM
option may be called "not a Megatron flag"; refused options fail in one line naming the option.
"""

from __future__ import annotations

import re

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags import versions
from megatron_ext.flags.catalog import ALSO_ACCEPTED, class_sizes, megatron_flags
from megatron_ext.flags.parser import build_megatron_parser, flag_catalog, parse_megatron_args
from megatron_ext.flags.table import EMIT_TABLE


@pytest.fixture(autouse=True)
def _core_v0_16_1_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the core_v0.16.1 table: parse with that catalog whatever megatron-core
    is installed (tests/unit/test_flag_versions.py covers core_v0.19.0's)."""
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: "0.16.1")


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--max-position-embeddings", "128", "--seq-length", "128", "--micro-batch-size", "1"]


def _parser_actions():
    parser = build_megatron_parser()
    return {o: a for a in parser._actions for o in a.option_strings}


def test_every_megatron_flag_has_exactly_one_class():
    table = flag_catalog()
    assert set(table) == set(megatron_flags())
    assert {e.kind for e in table.values()} == {"honoured", "no_effect", "refused"}
    sizes = class_sizes(table)
    assert sum(sizes.values()) == len(megatron_flags()) == 682
    for entry in table.values():
        if entry.kind != "honoured":
            assert entry.reason, entry.flag.option
        if entry.kind == "refused":
            assert entry.instead, entry.flag.option


def _megatron_default(text: str):
    enum = re.fullmatch(r"<\w+\.(\w+): .*>", text)  # <AttnBackend.auto: 5> -> 'auto'
    return repr(enum.group(1)) if enum else text


def test_honoured_flags_have_megatron_dest_and_default():
    actions = _parser_actions()
    for option, entry in flag_catalog().items():
        if entry.kind != "honoured":
            continue
        action = actions[option]
        assert action.dest == entry.flag.dest, option
        assert repr(action.default) == _megatron_default(entry.flag.default), option


def _with_value(entry) -> list[str]:
    flag = entry.flag
    if flag.nargs == 0:
        return [flag.option]
    choices = _parser_actions()[flag.option].choices
    if choices:  # a refused value among the parser's choices
        accepted = (flag.default_value(), *ALSO_ACCEPTED.get(flag.option, ()))
        return [flag.option, str(next(c for c in choices if c not in accepted))]
    return [flag.option] + ["3"] * (flag.nargs if isinstance(flag.nargs, int) else 1)


def test_no_effect_flags_parse_and_are_noted():
    entries = [e for o, e in flag_catalog().items()
               if e.kind == "no_effect" and o not in ("-h", "--help")]
    ns = parse_megatron_args(BASE + [token for e in entries for token in _with_value(e)])
    assert set(ns.no_effect_notes) == {e.note() for e in entries}


def test_refused_flags_fail_in_one_line_naming_the_flag():
    for option, entry in flag_catalog().items():
        if entry.kind != "refused":
            continue
        argv = BASE + _with_value(entry)
        if str(entry.flag.default_value()) in ("3", "3.0"):
            parse_megatron_args(argv)  # given its default: nothing to refuse
            continue
        with pytest.raises(PlanError) as err:
            parse_megatron_args(argv)
        message = str(err.value)
        assert message.startswith(option) and "\n" not in message, message
        assert "not a Megatron flag" not in message


def test_refused_flag_given_its_default_passes():
    parse_megatron_args(BASE + ["--expert-model-parallel-size", "1", "--moe-router-topk", "2",
                                "--main-grads-dtype", "fp32", "--ckpt-format", "torch_dist",
                                "--dataloader-type", "single"])


def test_refusal_names_feature_and_what_to_use():
    with pytest.raises(PlanError, match=r"^--moe-latent-size 8: latent MoE projections "
                       r"\(Nemotron-H style\) is not supported by megatron_ext; drop it"):
        parse_megatron_args(BASE + ["--moe-latent-size", "8"])
    with pytest.raises(PlanError, match=r"^--fp4-format e2m1: FP4 training .* use --fp8-format"):
        parse_megatron_args(BASE + ["--fp4-format", "e2m1"])


def test_only_strings_outside_the_file_are_not_megatron_flags():
    with pytest.raises(PlanError, match="--num-layer is not a Megatron flag"):
        parse_megatron_args(BASE + ["--num-layer", "3"])


def test_no_effect_flags_are_noted_once_with_their_reason():
    ns = parse_megatron_args(BASE + ["--log-num-zeros-in-grad", "--manual-gc",
                                     "--dist-ckpt-strictness", "log_all"])
    assert len(ns.no_effect_notes) == 3
    assert ns.no_effect_notes[0].startswith("--log-num-zeros-in-grad has no effect here: ")


def test_emitted_flags_are_honoured():
    table = flag_catalog()
    for _, _, flag, _ in EMIT_TABLE:
        if flag in table:
            assert table[flag].kind == "honoured", flag


def test_recompute_method_without_full_granularity_is_ignored_as_megatron_does():
    ns = parse_megatron_args(BASE + ["--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"])
    assert ns.recompute_granularity is None and ns.recompute_method is None
    with pytest.raises(PlanError, match="selective takes no --recompute-method"):
        parse_megatron_args(BASE + ["--recompute-activations", "--recompute-method", "uniform"])


def test_no_position_embedding_only_with_rope():
    ns = parse_megatron_args(BASE + ["--position-embedding-type", "rope",
                                     "--no-position-embedding"])
    assert not ns.add_position_embedding
    with pytest.raises(PlanError, match="--no-position-embedding is deprecated"):
        parse_megatron_args(BASE + ["--no-position-embedding"])


def test_flags_command_and_readme_show_the_table_sizes(capsys):
    from pathlib import Path

    from megatron_ext.cli import main

    sizes = class_sizes(flag_catalog())
    assert main(["flags"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"682 Megatron-LM core_v0.16.1 flags: {sizes['honoured']} honoured, "
                    f"{sizes['no_effect']} no effect, {sizes['refused']} refused")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert line in readme
    for kind, label in (("honoured", "honoured"), ("no_effect", "no effect here"),
                        ("refused", "refused")):
        assert f"| {label} | {sizes[kind]} |" in readme
    assert main(["flags", "moe-latent-size"]) == 0
    assert capsys.readouterr().out.startswith("--moe-latent-size: refused unless given its "
                                              "default")


def test_nan_check_follows_megatron_validate_args():
    """On by default; off under fp16 dynamic loss scaling (NaN/Inf grads are the scaler's
    signal there), as Megatron-LM's validate_args sets it."""
    assert parse_megatron_args(BASE).check_for_nan_in_loss_and_grad
    assert not parse_megatron_args(BASE + ["--fp16"]).check_for_nan_in_loss_and_grad
    assert parse_megatron_args(BASE + ["--fp16", "--loss-scale", "1024"]
                               ).check_for_nan_in_loss_and_grad


def test_async_save_and_its_worker_flags_are_honoured() -> None:
    """--async-save (checkpoint_async.py) with Megatron-LM's names and defaults; another format
    is refused in one line, as Megatron-LM refuses async saves outside torch_dist."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--train-iters", "2", "--lr", "1e-3", "--save", "ckpt", "--save-interval", "1"]
    ns = parse_megatron_args(base, world_size=1)
    assert (ns.async_save, ns.use_persistent_ckpt_worker,
            ns.ckpt_assume_constant_structure) == (False, False, False)
    ns = parse_megatron_args([*base, "--async-save", "--use-persistent-ckpt-worker",
                              "--ckpt-assume-constant-structure"], world_size=1)
    assert (ns.async_save, ns.use_persistent_ckpt_worker,
            ns.ckpt_assume_constant_structure) == (True, True, True)
    with pytest.raises(PlanError) as err:
        parse_megatron_args([*base, "--async-save", "--ckpt-format", "torch"], world_size=1)
    assert str(err.value).startswith("--ckpt-format torch: ") and "\n" not in str(err.value)
