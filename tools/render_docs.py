#!/usr/bin/env python
"""Re-run the commands of the excerpts in README.md and docs/*.md and rewrite the excerpts
(tests/doc_excerpts.py has the rules: template and keep modes, SPECS per excerpt).

    python tools/render_docs.py            # rewrite every excerpt
    python tools/render_docs.py --check    # exit 1 listing the excerpts that differ
    python tools/render_docs.py --only NAME [--only NAME ...] [--cheap]
    python tools/render_docs.py --training  # only the training and profiling runs' excerpts
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ext.warning_filters import install as install_warning_filters  # noqa: E402
from tests.doc_excerpts import DOCS, REPO, SPECS, excerpts, render_file  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 on drift")
    parser.add_argument("--only", action="append", help="render only this excerpt (repeatable)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--cheap", action="store_true", help="only the excerpts the test checks")
    kind.add_argument("--training", action="store_true",
                      help="only the excerpts of training and profiling runs (keep mode: real "
                           "runs on this machine, minutes on a CPU; the test never runs them)")
    args = parser.parse_args(argv)
    names = {m.group("name") for doc in DOCS for m in excerpts((REPO / doc).read_text())}
    unknown = sorted(set(args.only or ()) - names) + sorted(names - set(SPECS))
    if unknown:
        sys.stderr.write(f"render_docs.py: no excerpt or no spec for {', '.join(unknown)}\n")
        return 2
    drift: list[str] = []
    for doc in DOCS:
        try:
            drift += render_file(REPO / doc, only=set(args.only or ()) or None,
                                 cheap_only=args.cheap, runs_only=args.training,
                                 write=not args.check)
        except ValueError as err:  # the structure changed: the excerpt needs a hand edit
            sys.stderr.write(f"render_docs.py: {doc}: {err}\n")
            return 1
    verb = "differ from a fresh run" if args.check else "rewritten"
    sys.stderr.write(f"{len(drift)} excerpt(s) {verb}" + (f": {', '.join(drift)}\n" if drift
                                                          else "\n"))
    return 1 if args.check and drift else 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
