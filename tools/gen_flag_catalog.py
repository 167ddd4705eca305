"""Write megatron_ext/flags/megatron_lm_core_v<VERSION>_flags.json from a Megatron-LM source tree.

    git -C Megatron-LM archive core_v0.19.0 megatron | tar -x -C /tmp/mlm019
    python tools/gen_flag_catalog.py /tmp/mlm019 --tag core_v0.19.0 \
        --out megatron_ext/flags/megatron_lm_core_v0.19.0_flags.json

Builds the parser exactly as Megatron-LM's `parse_args` does
(`argparse.ArgumentParser(allow_abbrev=False)` + `add_megatron_arguments` from
`megatron/training/arguments.py` of the tree given) and records, for every option string, the
argparse dest, nargs, const, default and type: repr() text of const/default, the type's
`__name__` (`None` where argparse has none). Nothing is parsed from the source text, so the
dataclass defaults megatron-core feeds into the parser (ArgumentGroupFactory) are the tag's own.
core_v0.19's training code needs Python 3.12 (`typing.override`); run it with a 3.12 interpreter
that has torch (and six, regex, pydantic for the tokenizer modules arguments.py imports).

The tree goes first on sys.path, so the megatron-core that is imported is the tree's, not the
installed one. It needs torch (CPU is fine). megatron-core >= 0.19 imports `triton` from
`transformer/moe/ops/paged_stash.py` on the way to the parser; where triton is not installed
(torch's CPU builds) a module object stands in for that one ops module, which only defines GPU
kernels (the parser never calls them). `--check FILE` regenerates and compares with FILE instead
of writing (exit 1 on a difference), e.g. to confirm the 0.16.1 catalog is reproduced.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

ABOUT = ("Every option string of Megatron-LM {tag} megatron/training/arguments.py (the parser "
         "pretrain_gpt.py uses), with its argparse dest, nargs, const, default and type as that "
         "parser defines them.")


def _stand_in_for_triton_kernels() -> None:
    """0.19's MoE paged-stash kernels import triton at module import; the parser never uses
    them. Register the ops module (names only) when triton is absent."""
    if importlib.util.find_spec("triton") is not None:
        return
    name = "megatron.core.transformer.moe.ops.paged_stash"
    module = types.ModuleType(name)
    module.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
    module.paged_stash_copy_kernel = None  # type: ignore[attr-defined]
    module.paged_stash_pop_kernel = None  # type: ignore[attr-defined]
    sys.modules[name] = module


def build_parser(tree: Path) -> argparse.ArgumentParser:
    sys.path.insert(0, str(tree))
    for loaded in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[loaded]
    _stand_in_for_triton_kernels()
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return add_megatron_arguments(parser)


def _type_name(kind: object) -> str:
    if kind is None:
        return "None"
    return str(getattr(kind, "__name__", repr(kind)))


def catalog(parser: argparse.ArgumentParser, tag: str) -> dict:
    flags = {}
    for action in parser._actions:
        for option in action.option_strings:
            flags[option] = {
                "dest": action.dest,
                "nargs": action.nargs,
                "const": repr(action.const),
                "default": repr(action.default),
                "type": _type_name(action.type),
            }
    return {"about": ABOUT.format(tag=tag), "flags": flags}


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("tree", type=Path, help="directory holding megatron/ of the Megatron-LM tag")
    cli.add_argument("--tag", required=True, help="the tag the tree is, e.g. core_v0.19.0")
    target = cli.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", type=Path, help="catalog JSON to write")
    target.add_argument("--check", type=Path, help="compare with this catalog instead")
    args = cli.parse_args(argv)
    if not (args.tree / "megatron" / "training" / "arguments.py").is_file():
        cli.error(f"{args.tree} has no megatron/training/arguments.py")
    result = catalog(build_parser(args.tree.resolve()), args.tag)
    text = json.dumps(result, indent=1) + "\n"
    if args.check:
        if json.loads(args.check.read_text()) != result:
            old = json.loads(args.check.read_text())["flags"]
            new = result["flags"]
            diff = sorted(set(old) ^ set(new)) or [k for k in new if old[k] != new[k]]
            sys.stderr.write(f"{args.check} differs from {args.tag}: {diff[:10]}\n")
            return 1
        sys.stderr.write(f"{args.check} matches {args.tag} ({len(result['flags'])} options)\n")
        return 0
    args.out.write_text(text)
    sys.stderr.write(f"wrote {args.out}: {len(result['flags'])} options of {args.tag}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
