"""Megatron-LM pretrain_gpt.py arguments: one argparse parser with Megatron's names and meanings.

Flag names, dests, defaults and choices follow Megatron-LM core_v0.16.1
`megatron/training/arguments.py` (core_v0.19.0's with `megatron_version` 0.19: its flag set, and
its defaults where they changed; flags/versions.py), so a Megatron launch script works unchanged
with megatron_ext's pretrain_gpt.py; cross-flag rules Megatron-LM enforces in `validate_args` and
`TransformerConfig.__post_init__` are checked in flags/checks.py. megatron_ext adds
--strategy-config, --vocab-parallel, --flexsp and --cpu.

The groups below define the honoured flags with their real types. Every other Megatron-LM flag
is added from flags/catalog.py's table (Megatron's dest, nargs and default; values kept as text)
and then either noted as having no effect here (`ns.no_effect_notes`, logged once by
pretrain_gpt.py) or refused when given a value other than Megatron-LM's default. Every problem
is a one-line PlanError that names the flag: strings that are not Megatron flags, refused
flags, bad values and inconsistent combinations. Nothing here imports megatron.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence

from megatron_ext.errors import PlanError
from megatron_ext.flags.catalog import (
    Entry,
    catalog,
    check_unhonoured,
    megatron_flags,
    option_sets,
)
from megatron_ext.flags.checks import (
    apply_aliases,
    validate_megatron_args,
)
from megatron_ext.flags.fp8 import add_fp8_args
from megatron_ext.flags.mla import add_mla_args
from megatron_ext.flags.moe import add_moe_args
from megatron_ext.flags.to_plan import (
    apply_strategy_config,
    plan_from_megatron_args,
)
from megatron_ext.flags.training import add_training_groups
from megatron_ext.flags.types import positive_int
from megatron_ext.flags.versions import BASE, FlagCatalogVersion, resolve, wrong_version_message
from megatron_ext.schema import closest

__all__ = ["build_megatron_parser", "parse_megatron_args", "plan_from_megatron_args"]


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse that raises a one-line PlanError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanError(message)


def build_megatron_parser(prog: str = "pretrain_gpt.py",
                          version: FlagCatalogVersion = BASE) -> argparse.ArgumentParser:
    parser = _honoured_parser(prog)
    _version_defaults(parser, version)
    _add_unhonoured(parser, honoured_options(), version)
    return parser


def _version_defaults(parser: argparse.ArgumentParser, version: FlagCatalogVersion) -> None:
    """Honoured flags whose Megatron-LM default changed in `version` get that version's default
    (core_v0.19.0: --data-parallel-sharding-strategy optim_grads_params)."""
    if version == BASE:
        return
    base, mine = megatron_flags(BASE), megatron_flags(version)
    for action in parser._actions:
        for option in action.option_strings:
            if option in base and option in mine and base[option].default != mine[option].default:
                action.default = mine[option].default_value()


def _honoured_parser(prog: str) -> argparse.ArgumentParser:
    parser = MegatronArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Megatron-LM pretrain_gpt.py arguments accepted by megatron_ext",
    )
    _add_model(parser)
    _add_parallel(parser)
    add_moe_args(parser)
    add_mla_args(parser)
    _add_batch_and_precision(parser)
    add_fp8_args(parser)
    add_training_groups(parser)
    _add_megatron_ext(parser)
    return parser


def honoured_options() -> frozenset[str]:
    """Option strings the parser defines with their meaning (catalog.py may still refuse some
    of them until the training path implements them)."""
    global _HONOURED
    if _HONOURED is None:
        parser = _honoured_parser("pretrain_gpt.py")
        _HONOURED = frozenset(o for a in parser._actions for o in a.option_strings)
    return _HONOURED


_HONOURED: frozenset[str] | None = None


def flag_catalog(version: FlagCatalogVersion = BASE) -> dict[str, Entry]:
    """Every Megatron-LM option of `version` -> its class (honoured, no effect here, refused)."""
    return catalog(honoured_options(), version)


def check_version_flags(argv: Sequence[str], version: FlagCatalogVersion) -> None:
    """A flag another catalog has and `version`'s lacks: one line naming the version and what
    replaces it there (before argparse would call it "not a Megatron flag")."""
    mine = option_sets()[version.version]
    others = {v: options for v, options in option_sets().items() if v != version.version}
    for token in argv:
        option = token.split("=", 1)[0]
        if option.startswith("--") and option not in mine:
            message = wrong_version_message(option, version, others)
            if message is not None:
                raise PlanError(message)


def _add_unhonoured(parser: argparse.ArgumentParser, honoured: frozenset[str],
                    version: FlagCatalogVersion) -> None:
    """Megatron-LM's other flags, so that they parse; catalog.py decides what each one does."""
    g = parser.add_argument_group(
        "other Megatron-LM flags: no effect here, or refused unless given their default "
        "(`megatron-ext flags` lists each one's class)")
    for option, flag in megatron_flags(version).items():
        if option in honoured:
            continue
        default = flag.default_value()
        if flag.nargs == 0:
            const = (not default) if isinstance(default, bool) else True
            g.add_argument(option, dest=flag.dest, action="store_const", const=const,
                           default=default, help=argparse.SUPPRESS)
        else:
            g.add_argument(option, dest=flag.dest, nargs=flag.nargs, default=default,
                           help=argparse.SUPPRESS)


def parse_megatron_args(
    argv: Sequence[str], *, world_size: int | None = None, model_only: bool = False,
    megatron_version: str | None = None,
) -> argparse.Namespace:
    """Parse and validate Megatron-LM flags like Megatron-LM's parse_args + validate_args.

    Derived defaults are filled in as Megatron-LM does (ffn_hidden_size, kv_channels,
    global_batch_size when `world_size` is known, ...). `ns.explicit_args` holds the dests given
    on the command line. With --strategy-config the plan file is loaded and checked against the
    given flags; values it carries and the flags omit are filled in, values that vary per layer
    are None. `model_only` drops the training requirements (--seq-length, --micro-batch-size)
    for files that describe just a model shape. `megatron_version` picks the flag catalog
    (flags/versions.py; None: the installed megatron-core's, else the newest).
    """
    argv = list(argv)
    version = resolve(megatron_version)
    check_version_flags(argv, version)
    parser = build_megatron_parser(version=version)
    ns, extra = parser.parse_known_args(argv)
    if extra:
        raise PlanError(_unknown_message(extra, parser._option_string_actions))
    unset = object()  # not a str: argparse would run a str default through `type`
    explicit = build_megatron_parser(version=version)
    explicit.set_defaults(**dict.fromkeys(vars(ns), unset))
    given = vars(explicit.parse_known_args(argv)[0])
    ns.explicit_args = frozenset(dest for dest, value in given.items() if value is not unset)
    ns.no_effect_notes = tuple(entry.note()
                               for entry in check_unhonoured(ns, argv, flag_catalog(version)))
    apply_aliases(ns)
    if ns.strategy_config is not None:
        apply_strategy_config(ns, parser, world_size=world_size)
    validate_megatron_args(ns, world_size=world_size, model_only=model_only)
    return ns


def _unknown_message(extra: list[str], known: Iterable[str] = ()) -> str:
    """One line for the first string that is no flag of the parser (`known`: its option
    strings), with the closest known flag when one is close (difflib)."""
    for token in extra:
        if token.startswith("-") and not _is_number(token):
            flag = token.split("=", 1)[0]
            if flag.startswith("--export-"):
                return (f"{flag} is a flag of Megatron-LM's ModelOpt post-training scripts "
                        "(megatron/post_training/arguments.py), not of pretrain_gpt.py's parser; "
                        "megatron_ext does not support ModelOpt")
            hint = closest(flag, [o for o in known if o.startswith("--")])
            return (
                f"{flag} is not a Megatron flag megatron_ext accepts; "
                + (f"did you mean {hint}? " if hint else "check the spelling ")
                + "(pretrain_gpt.py --help lists them)"
            )
    return f"unexpected argument {extra[0]!r}; Megatron flags start with --"


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _add_model(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model shape (the plan's ModelSpec)")
    g.add_argument("--num-layers", type=positive_int, default=None)
    g.add_argument("--hidden-size", type=positive_int, default=None)
    g.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                   help="default 4*hidden, or int(8*hidden/3/64)*64 with --swiglu")
    g.add_argument("--num-attention-heads", type=positive_int, default=None)
    g.add_argument("--kv-channels", type=positive_int, default=None,
                   help="per-head width; default hidden/heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=positive_int, default=1,
                   help="key/value heads; used only with --group-query-attention")
    g.add_argument("--max-position-embeddings", type=positive_int, default=None)
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated: same as --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None)
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding",
                   help="deprecated: only valid with --position-embedding-type rope")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.x rope scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true", dest="add_qkv_bias")
    g.add_argument("--qk-layernorm", action="store_true", help="norm on queries and keys")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q.K by the layer number (fp16 headroom); implies "
                   "--attention-softmax-in-fp32")
    g.add_argument("--vocab-size", type=positive_int, default=None,
                   help="vocabulary before padding; Megatron-LM reads it with NullTokenizer")


def _add_parallel(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism, pipeline layout and recompute")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--decoder-first-pipeline-num-layers", type=positive_int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=positive_int, default=None)
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="e.g. 'Et*3|tL': E embedding, t layer, L loss, | stage boundary")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None,
                   help="interleaved 1F1B: layers per model chunk (even stages only)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=positive_int, default=None,
                   help="interleaved 1F1B: model chunks per pipeline rank")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   default=False)
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true", default=False)
    g.add_argument("--context-parallel-size", type=positive_int, default=1)
    g.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                   help="p2p (ring; the plan's cp), a2a (Ulysses; the plan's ulysses), "
                   "allgather, or a2a+p2p with --hierarchical-context-parallel-sizes U C")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=positive_int,
                   default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="Transformer Engine userbuffers overlap of the sequence-parallel "
                   "collectives with their GEMMs: priced by the planner, refused by the training "
                   "runtime")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO-1 (zero=1)")
    g.add_argument("--use-torch-fsdp2", action="store_true", help="torch FSDP2 (zero=3)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    g.add_argument("--recompute-activations", action="store_true",
                   help="same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", type=str, default=None,
                   choices=["full", "selective"])
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=positive_int, default=None)
    g.add_argument("--recompute-modules", nargs="*", type=str, default=None,
                   help="megatron_ext's selective recompute covers core_attn only")


def _add_batch_and_precision(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("batch and precision")
    g.add_argument("--micro-batch-size", type=positive_int, default=None,
                   help="samples per data-parallel replica per micro-batch")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="samples per step; default micro-batch-size x data-parallel size")
    g.add_argument("--seq-length", type=positive_int, default=None)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")


def _add_megatron_ext(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron_ext (not in Megatron-LM)")
    g.add_argument("--strategy-config", type=str, default=None, metavar="PLAN.json",
                   help="run the per-layer layout of this plan file (megatron-ext search)")
    g.add_argument("--vocab-parallel", action="store_true",
                   help="split embedding and output layer over the pipeline stages")
    g.add_argument("--vocab-parallel-algorithm", type=int, default=1, choices=[1, 2])
    g.add_argument("--flexsp", action="store_true",
                   help="flexible sequence parallelism: Ulysses groups chosen per step")
    g.add_argument("--flexsp-max-group-size", type=positive_int, default=8)
    g.add_argument("--flexsp-min-group-size", type=positive_int, default=1)
    g.add_argument("--cpu", action="store_true", help="run on CPU with gloo")
    g.add_argument("--megatron-init", action="store_true",
                   help="initialise weights with megatron-core's own per-rank init (Megatron-LM's "
                   "weights for the same --seed and layout) instead of the plan-invariant init "
                   "(the same model under every plan)")
