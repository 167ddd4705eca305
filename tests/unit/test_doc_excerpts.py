"""The command excerpts in README.md and docs/ match a fresh run of their commands.

Every excerpt marked `<!-- render: NAME -->` is produced by tools/render_docs.py. Here each
`cheap` one (search, evaluate, args, plan-from-args, flags, validate, flexsp plan, launch errors:
deterministic, seconds each) is rendered again from a fresh run and compared with the text on
disk, timings masked: the same lines, in the same places, with the same numbers. A failure means
the excerpt drifted: run `python tools/render_docs.py` (or edit the excerpt, if its structure
changed) and commit the result. Excerpts of training runs and measured profiles are rendered by
the script only (their numbers depend on the machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import doc_excerpts as render_docs

REPO = Path(__file__).resolve().parents[2]

EXCERPTS = [(doc, m.group("name"), m.group("body")) for doc in render_docs.DOCS
            for m in render_docs.excerpts((REPO / doc).read_text())]


def test_every_excerpt_has_a_spec_and_every_spec_an_excerpt() -> None:
    names = [name for _, name, _ in EXCERPTS]
    assert len(names) == len(set(names)), "an excerpt name is used twice"
    assert set(names) == set(render_docs.SPECS)


@pytest.mark.parametrize(("doc", "name", "body"),
                         [e for e in EXCERPTS if render_docs.SPECS[e[1]].cheap],
                         ids=[e[1] for e in EXCERPTS if render_docs.SPECS[e[1]].cheap])
def test_excerpt_matches_a_fresh_run(doc: str, name: str, body: str) -> None:
    with render_docs.scratch_dir() as tmp:
        fresh = render_docs.render_body(name, body, Path(tmp))
    assert render_docs.mask_timings(fresh) == render_docs.mask_timings(body), (
        f"{doc}: excerpt {name} differs from a fresh run; run python tools/render_docs.py")


def test_template_keeps_structure_and_takes_the_fresh_numbers() -> None:
    shown = ["model: x, 1.5B", "...", "  1. 2.0 s: pp 1, ... layers tp1", "done"]
    fresh = ["model: x, 1.7B", "progress 1", "progress 2", "  1. 2.5 s: pp 2, mb 4, layers tp2",
             "done"]
    assert render_docs.fill_template(shown, fresh, "t") == [
        "model: x, 1.7B", "...", "  1. 2.5 s: pp 2, ... layers tp2", "done"]
    # a line the output no longer has, a line inserted between two adjacent ones, output that
    # goes on after the last shown line: each is an error, not a silent rewrite
    for bad_fresh in (["model: y, 1B", "done"],
                      ["model: x, 1.7B", "  1. 2.5 s: pp 2, layers tp2", "new line", "done"],
                      [*fresh, "more"]):
        with pytest.raises(ValueError):
            render_docs.fill_template(shown, bad_fresh, "t")


def test_keep_mode_and_timing_masks() -> None:
    assert render_docs.keep_lines(["a 1", "b", "c", "a 2", "d"], ("^a",)) == [
        "a 1", "...", "a 2", "..."]
    assert render_docs.mask_timings("planner: 14.8 ms CPU, 1.5 s") == "planner: # ms CPU, 1.5 s"


def test_keep_mode_cuts_the_fields_of_an_iteration_line() -> None:
    """The training excerpts' iteration line keeps the loss and the predicted / measured time;
    a line no cut matches is kept whole, and every training spec is left out of the test."""
    line = ("[2026-11-29 08:15:07]  iteration        1/       4 | consumed samples:           32 "
            "| elapsed time per iteration (ms): 1790.9 | learning rate: 3.0E-03 | "
            "lm loss: 6.478097290E+00 | loss scale: 1.0 | grad norm: 2.1 | "
            "predicted 904.8 ms / measured 1790.9 ms (+97.9%) |")
    spec = render_docs.SPECS["readme-train"]
    assert render_docs.keep_lines(["W0 noise", line, "  load: none"], spec.keep, spec.cut) == [
        "...", "[2026-11-29 08:15:07]  iteration        1/       4 | ... | "
        "lm loss: 6.478097290E+00 | ... | predicted 904.8 ms / measured 1790.9 ms (+97.9%) |",
        "  load: none"]
    assert [n for n, s in render_docs.SPECS.items() if s.keep] == [
        n for n, s in render_docs.SPECS.items() if not s.cheap]
