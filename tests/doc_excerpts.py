"""The command excerpts of README.md and docs/*.md, re-run and rewritten: what
`python tools/render_docs.py` does and tests/unit/test_doc_excerpts.py checks.

An excerpt is a fenced block between `<!-- render: NAME -->` and `<!-- /render -->`. Its lines
starting with `$ ` are commands (run with bash from a scratch directory that links the
repository's examples/, tests/ and tools/, stdout and stderr together, as a terminal shows them);
the lines after each are its output. `...` alone on a line marks output lines left out.

Two ways to render (SPECS below says which, per excerpt):
- template (default; deterministic commands): the excerpt is its own template. Each output line
  is matched, in order, to a fresh output line of the same shape (the same text with every
  number masked) and replaced by it; lines not separated by `...` must stay adjacent, and an
  excerpt not ending in `...` must end where the output ends. A change of structure is an error
  naming the line (edit the excerpt by hand, then render again); a change of numbers is
  rewritten.
- keep (machine-dependent runs: training, measured profiles): the fresh lines matching the
  spec's `keep` regexes, `...` for the runs of lines left out; in a kept line, the first group
  of each `cut` regex that matches becomes `...` (the fields of a long line left out).

tests/unit/test_doc_excerpts.py renders every `cheap` excerpt afresh and compares it with the
text on disk, timings masked (`TIMINGS`); the others (training and profiling runs, minutes on
a CPU) are rendered by this script only.

    python tools/render_docs.py            # rewrite every excerpt
    python tools/render_docs.py --check    # exit 1 listing the excerpts that differ
    python tools/render_docs.py --only NAME [--only NAME ...] [--cheap | --training]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))
BLOCK = re.compile(r"<!-- render: (?P<name>[\w.-]+) -->\n```(?P<lang>\w*)\n(?P<body>.*?)```\n"
                   r"<!-- /render -->", re.S)
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")  # no groups: NUMBER.split keeps no separators
# Numbers that differ from run to run: masked when an excerpt is compared with a fresh run.
TIMINGS = (
    re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"),  # log timestamps
    re.compile(r"planner: [\d.]+ ms CPU"),
    re.compile(r"\[ *[\d.]+ s\]"),  # search progress
    re.compile(r"took [\d.]+ (?:ms|s)"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Spec:
    """How one excerpt is produced."""

    cheap: bool = True
    """Rendered again by tests/unit/test_doc_excerpts.py (deterministic and a few seconds)."""
    runs: dict[str, str] = field(default_factory=dict)
    """Shown command (after `$ `) -> the command that runs, where the shown one is cut."""
    keep: tuple[str, ...] = ()
    """Regexes of output lines to keep (keep mode); empty: template mode."""
    cut: tuple[str, ...] = ()
    """Keep mode: regexes with one group, the part of a kept line shown as `...`."""
    setup: str = ""
    """Shell run first in the scratch directory, not shown."""


LLAMA_FLAGS = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 "
               "--num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
               "--position-embedding-type rope --normalization RMSNorm --swiglu "
               "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000")
README_PLAN_FLAGS = (f"{LLAMA_FLAGS} --tensor-model-parallel-size 4 --sequence-parallel "
                     "--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 14 "
                     "--use-distributed-optimizer --recompute-granularity full "
                     "--recompute-method block --recompute-num-layers 4 --micro-batch-size 2 "
                     "--global-batch-size 128 --bf16 --lr 3e-4 --train-iters 1000 --mock-data")
"""README's plan-from-args example, every flag spelled out (docs/cli.md elides some)."""
PLAN_FROM_ARGS = (f"megatron-ext plan-from-args --world-size 16 --out mine.json -- "
                  f"{README_PLAN_FLAGS}")
# a 6-rank plan giving layers [0, 4) tp=3 on a 32-head model (cli.md's `validate bad.json`)
BAD_PLAN = """python - <<'PY'
import json
d = json.load(open("examples/plans/llama2-7b_uniform_tp2_pp2.json"))
d.update(world_size=6, pp=1, stages=[{"start": 0, "end": 32}], micro_batch_size=6,
         global_batch_size=60, vocab={"mode": "tp", "tp": 2, "algorithm": 1}, prediction=None)
d["cluster"]["gpus_per_node"] = 6
d["layers"] = [dict(d["layers"][0], start=0, end=4, tp=3, dp=2),
               dict(d["layers"][0], start=4, end=32, tp=2, dp=3)]
json.dump(d, open("bad.json", "w"))
PY"""
TRAIN_PLAN = "examples/plans/tiny-llama_searched_cpu4.json"
TRAIN = ('megatron-ext launch --nproc_per_node 4 examples/pretrain_gpt.py --cpu '
         '--transformer-impl local "${PLAN_ARGS[@]}" --mock-data --tokenizer-type NullTokenizer '
         '--train-iters 4 --lr 3e-3 --log-interval 1')
"""README's training run of the searched 4-rank CPU plan (PLAN_ARGS from `megatron-ext args`)."""
TRAIN_LOG = (r"^megatron-ext launch: checked ", r"\] plan: ", r"^  layers \[",
             r"^  predicted iteration", r"^  data: ", r"^  load: ", r"\] backend: ",
             r" iteration +1/", r" iteration +(\d+)/ +\1 \|")
"""The log lines a training excerpt shows: the check, the plan, the first and last iteration."""
ITERATION_CUT = (r" iteration +\d+/ *\d+ \| (.*?) \| lm loss",
                 r"lm loss: \S+ \| (.*?) \| predicted ")
"""An iteration line as excerpts show it: the loss and the predicted / measured time."""
SPECS: dict[str, Spec] = {
    "readme-search-70b": Spec(),
    "readme-search-p90": Spec(),
    "readme-args": Spec(runs={
        "megatron-ext plan-from-args --world-size 16 --out mine.json -- --num-layers 32 ... "
        "--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
        "--decoder-last-pipeline-num-layers 14 --use-distributed-optimizer "
        "--recompute-granularity full --recompute-method block --recompute-num-layers 4 "
        "--micro-batch-size 2 --global-batch-size 128 --bf16 ...": PLAN_FROM_ARGS}),
    "readme-flags": Spec(),
    "readme-evaluate": Spec(),
    "cli-search": Spec(),
    "cli-search-p90": Spec(),
    "cli-hf": Spec(),
    "cli-args": Spec(),
    "cli-plan-from-args": Spec(runs={
        "megatron-ext plan-from-args --world-size 8 -- ... --tensor-model-parallel-size 3":
        f"megatron-ext plan-from-args --world-size 8 -- {LLAMA_FLAGS} "
        "--tensor-model-parallel-size 3 --micro-batch-size 1"}),
    "cli-flags": Spec(),
    "cli-validate": Spec(setup=BAD_PLAN),
    "cli-evaluate": Spec(),
    "cli-evaluate-json": Spec(),
    "cli-flexsp": Spec(),
    "cli-launch-errors": Spec(),
    "moe-search": Spec(),
    "readme-train": Spec(cheap=False, keep=TRAIN_LOG, cut=ITERATION_CUT, runs={
        TRAIN: f"mapfile -t PLAN_ARGS < <(megatron-ext args {TRAIN_PLAN} 2>/dev/null); {TRAIN}"}),
    "cli-profile-hardware": Spec(cheap=False, keep=(
        r" node\(s\) x \d+ ranks, ", r"^collective ", r"^\w+ +2 +1 +2 +[\d.]+ ",
        r"^all_to_all +4 +1 +4 ", r"^wrote ")),
    "cli-profile-model": Spec(cheap=False, keep=(
        r"^tiny-llama on ", r"^ tp  sp ", r"^ +1 +n +1 +64 ", r"^ +1 +n +2 +128 ",
        r"^ +2 +y +2 +128 ", r"^fit ", r"^wrote "),
        cut=(r"recompute_s [^,]*, (.*)$",)),
}


def excerpts(text: str) -> Iterator[re.Match[str]]:
    return BLOCK.finditer(text)


def segments(body: str) -> list[tuple[str, list[str]]]:
    """(command, its shown output lines) for each `$ ` line of an excerpt."""
    out: list[tuple[str, list[str]]] = []
    for line in body.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line.rstrip())  # as run_command's lines
        else:
            raise ValueError(f"excerpt starts with {line!r}, not a `$ ` command")
    return out


def shape(line: str) -> str:
    return NUMBER.sub("#", line)


def run_command(command: str, cwd: Path) -> list[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800,
                            check=False)
    # trailing blanks (padded table columns) are not kept in markdown
    return [x.rstrip() for x in result.stdout.rstrip("\n").split("\n")] if result.stdout.strip() \
        else []


def line_pattern(line: str) -> re.Pattern[str]:
    """A shown line as a pattern: its numbers match any number, and a `...` inside it (a cut
    part of a long line) matches any text; each kept part is a group."""
    def masked(part: str) -> str:
        pieces = NUMBER.split(part)  # text, number, text, ...: the numbers become patterns
        return NUMBER.pattern.join(re.escape(piece) for piece in pieces)

    return re.compile(".*?".join(f"({masked(part)})" for part in line.split("...")))


def fill_template(shown: list[str], fresh: list[str], where: str) -> list[str]:
    """`shown` with each non-`...` line replaced by the fresh line of the same shape: matched in
    order, adjacent unless a `...` separates them, from the first fresh line unless the excerpt
    starts with `...`, and to the last unless it ends with one."""
    patterns = [None if x == "..." else line_pattern(x) for x in shown]
    sys.setrecursionlimit(max(1000, 4 * len(shown) + 100))

    def match(t: int, f: int, gap: bool) -> list[int] | None:
        if t == len(shown):
            return [] if gap or f == len(fresh) else None
        pattern = patterns[t]
        if pattern is None:
            return match(t + 1, f, True)
        for i in (range(f, len(fresh)) if gap else range(f, min(f + 1, len(fresh)))):
            if pattern.fullmatch(fresh[i]):
                rest = match(t + 1, i + 1, False)
                if rest is not None:
                    return [i, *rest]
        return None

    found = match(0, 0, False)
    if found is None:
        missing = next((x for x, p in zip(shown, patterns)
                        if p is not None and not any(p.fullmatch(f) for f in fresh)), None)
        why = (f"the line {missing!r} is no longer in the output" if missing else
               "the lines are still there, but not in that order or with other lines between "
               "them (mark left-out lines with `...`)")
        raise ValueError(f"{where}: {why}; edit the excerpt by hand, then render again")
    rows = iter(found)
    out = []
    for line, pattern in zip(shown, patterns):
        if pattern is None:
            out.append(line)
            continue
        m = pattern.fullmatch(fresh[next(rows)])
        assert m is not None
        out.append("...".join(m.groups()))
    return out


def keep_lines(fresh: list[str], keep: tuple[str, ...], cut: tuple[str, ...] = ()
               ) -> list[str]:
    patterns = [re.compile(k) for k in keep]
    cuts = [re.compile(c) for c in cut]
    out: list[str] = []
    for line in fresh:
        if any(p.search(line) for p in patterns):
            for c in cuts:  # in the order given, each on the line as cut so far
                m = c.search(line)
                if m is not None:
                    line = line[:m.start(1)] + "..." + line[m.end(1):]
            out.append(line)
        elif not out or out[-1] != "...":
            out.append("...")
    return out


def render_body(name: str, body: str, workdir: Path) -> str:
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"excerpt {name!r} has no entry in tools/render_docs.py SPECS")
    if spec.setup:
        run_command(spec.setup, workdir)
    lines: list[str] = []
    for command, shown in segments(body):
        fresh = run_command(spec.runs.get(command, command), workdir)
        lines.append(f"$ {command}")
        if spec.keep:
            lines += keep_lines(fresh, spec.keep, spec.cut)
        else:
            lines += fill_template(shown, fresh, f"{name}: $ {command}")
    return "\n".join(lines) + "\n"


def scratch_dir() -> tempfile.TemporaryDirectory[str]:
    tmp = tempfile.TemporaryDirectory(prefix="render_docs_")
    for sub in ("examples", "tests", "tools"):
        os.symlink(REPO / sub, Path(tmp.name) / sub)
    return tmp


def mask_timings(text: str) -> str:
    for pattern in TIMINGS:
        text = pattern.sub(lambda m: NUMBER.sub("#", m.group(0)), text)
    return text


def render_file(path: Path, *, only: set[str] | None, cheap_only: bool,
                write: bool, runs_only: bool = False) -> list[str]:
    """Render the excerpts of one file (cheap_only: the cheap ones; runs_only: the others, the
    training and profiling runs); returns the names whose text changed."""
    text = path.read_text()
    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name, body = match.group("name"), match.group("body")
        if ((only and name not in only) or (cheap_only and not SPECS[name].cheap)
                or (runs_only and SPECS[name].cheap)):
            return match.group(0)
        with scratch_dir() as tmp:
            new = render_body(name, body, Path(tmp))
        if mask_timings(new) != mask_timings(body):
            changed.append(name)
        return match.group(0).replace(body, new)

    new_text = BLOCK.sub(replace, text)
    if write and new_text != text:
        path.write_text(new_text)
    return changed
