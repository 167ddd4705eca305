"""Megatron-LM's FP8 flags: defined with their names, dests and defaults (core_v0.16.1
arguments.py, generated from TransformerConfig's fp8 fields), read into the plan's FP8Spec, and
printed back (`megatron-ext args`).

Flag -> TransformerConfig field (Megatron-LM core_transformer_config_from_args,
arguments.py:1306-1331): --fp8-format -> fp8, --fp8-recipe -> fp8_recipe, --fp8-margin,
--fp8-amax-history-len, --fp8-amax-compute-algo, --no-fp8-wgrad (fp8_wgrad=False),
--first-last-layers-bf16, --num-layers-at-start-in-bf16, --num-layers-at-end-in-bf16 by name;
--fp8-param-gather -> fp8_param (and DDP fp8_param_gather). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.specs import FP8Spec

RECIPE_CHOICES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
"""Megatron-LM's --fp8-recipe choices; `custom` is refused (fp8_from_args)."""

DESTS: tuple[tuple[str, str, Any], ...] = (
    # (FP8Spec field, Megatron-LM args dest, Megatron-LM's default)
    ("format", "fp8", None),
    ("recipe", "fp8_recipe", "delayed"),
    ("margin", "fp8_margin", 0),
    ("amax_history_len", "fp8_amax_history_len", 1),
    ("amax_compute_algo", "fp8_amax_compute_algo", "most_recent"),
    ("wgrad", "fp8_wgrad", True),
    ("param_gather", "fp8_param_gather", False),
    ("first_last_layers_bf16", "first_last_layers_bf16", False),
    ("num_layers_at_start_in_bf16", "num_layers_at_start_in_bf16", 1),
    ("num_layers_at_end_in_bf16", "num_layers_at_end_in_bf16", 1),
)
OPTIONS = frozenset({
    "--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len",
    "--fp8-amax-compute-algo", "--no-fp8-wgrad", "--disable-fp8-wgrad", "--fp8-param-gather",
    "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16",
})


def add_fp8_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FP8 training (Transformer Engine; plan field fp8)")
    g.add_argument("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"],
                   help="FP8 GEMMs in the transformer layers: e4m3, or hybrid (E4M3 forward, "
                   "E5M2 gradients)")
    g.add_argument("--fp8-recipe", default="delayed", choices=list(RECIPE_CHOICES),
                   help="scaling recipe (mxfp8: Blackwell only; custom is refused)")
    g.add_argument("--fp8-margin", type=int, default=0)
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", default="most_recent",
                   choices=["most_recent", "max"])
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", action="store_false",
                   dest="fp8_wgrad", help="weight-gradient GEMMs in bf16 (delayed recipe)")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="FP8 primary weights, all-gathered in FP8 (distributed optimizer)")
    g.add_argument("--first-last-layers-bf16", action="store_true")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def fp8_from_args(ns: argparse.Namespace) -> FP8Spec | None:
    """The FP8Spec the flags give (None without --fp8-format); one-line PlanError otherwise.
    Megatron-LM ignores the other FP8 flags without --fp8-format (fp8_utils.py:614-616); so
    does this, except --fp8-param-gather, which Megatron-LM rejects then
    (transformer_config.py:1027-1028)."""
    if ns.fp8 is None:
        if ns.fp8_param_gather:
            raise PlanError("--fp8-param-gather needs --fp8-format (FP8 parameters without FP8 "
                            "training); add --fp8-format e4m3|hybrid or drop it")
        return None
    if ns.fp8_recipe == "custom":
        raise PlanError("--fp8-recipe custom: a recipe built by a quantizer factory module "
                        "(--fp8-quantizer-factory) is not supported by megatron_ext; use "
                        "delayed, tensorwise, blockwise or mxfp8")
    return FP8Spec(
        format=ns.fp8, recipe=ns.fp8_recipe, margin=ns.fp8_margin,
        amax_history_len=ns.fp8_amax_history_len,
        amax_compute_algo=ns.fp8_amax_compute_algo, wgrad=ns.fp8_wgrad,
        param_gather=ns.fp8_param_gather, first_last_layers_bf16=ns.first_last_layers_bf16,
        num_layers_at_start_in_bf16=ns.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=ns.num_layers_at_end_in_bf16,
    )


def fp8_values(fp8: FP8Spec | None) -> dict[str, Any]:
    """Megatron-LM dest -> value of `fp8` for `megatron-ext args` (None: flag absent, i.e.
    Megatron's default; --fp8-recipe is printed whenever FP8 is on, so a reader sees it)."""
    out: dict[str, Any] = {}
    for field, dest, default in DESTS:
        value = None if fp8 is None else getattr(fp8, field)
        keep = value is not None and (value != default or dest == "fp8_recipe")
        out[dest] = value if keep else None
    return out
