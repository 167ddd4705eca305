"""Regenerate patches/v<major.minor>/*.diff from the installed megatron-core (source-level
`cpu_compat`).

    python patches/make_diffs.py            # rewrite patches/v0.16/*.diff (or v0.19/, ...)
    python patches/make_diffs.py --check    # exit 1 if the committed diffs are stale

Each diff is the source-level twin of one `cpu_compat` patch, limited to the megatron-core
sites listed for it in patches/README.md. One directory per megatron-core release line holds the
diffs of the patches that line needs (`CompatPatch.versions`: te_gemm_stub has no v0.19 diff).
Every edit states how many matches it expects in each line, so another megatron-core version
fails loudly instead of producing a wrong diff. Diffs are
independent of each other (no two touch the same lines) and apply from the site-packages root
with `patch -p1`. Every replacement keeps GPU behaviour unchanged (CPU fallback only when
`torch.cuda.is_available()` is False), except `type_alias`, which checks dtypes, not type names.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import megatron.core
from megatron.core import package_info

from megatron_ext.megatron_adapter.cpu.patches import PATCHES

SITE_PACKAGES = Path(megatron.core.__file__).resolve().parents[2]
VERSION = str(package_info.__version__)
LINE = ".".join(VERSION.split(".")[:2])  # "0.16", "0.19"
PATCH_ROOT = Path(__file__).resolve().parent
PATCH_DIR = PATCH_ROOT / f"v{LINE}"
"""This megatron-core line's diffs."""
CUR_DEV = 'torch.cuda.current_device() if torch.cuda.is_available() else "cpu"'


@dataclass(frozen=True, kw_only=True, slots=True)
class Edit:
    """A regex substitution in one megatron/core file, with its expected number of matches."""

    path: str
    """Relative to megatron/core/."""
    pattern: str
    """`re.MULTILINE` pattern."""
    repl: str
    """Replacement (may use groups)."""
    count: int
    """Exact number of matches expected in megatron-core 0.16.1."""
    count_0_19: int | None = None
    """Exact number expected in 0.19.x (None: the same as `count`; 0: no such site in 0.19)."""

    def expected(self) -> int:
        """Matches expected in the installed megatron-core's line."""
        if LINE == "0.16" or self.count_0_19 is None:
            return self.count
        return self.count_0_19


def _sync(path: str, count: int, count_0_19: int | None = None) -> Edit:
    """`torch.cuda.synchronize()` statement -> guarded by `torch.cuda.is_available()`."""
    return Edit(
        path=path,
        pattern=r"^( *)torch\.cuda\.synchronize\(\)$",
        repl=r"\1if torch.cuda.is_available():\n\1    torch.cuda.synchronize()",
        count=count,
        count_0_19=count_0_19,
    )


def _literal(path: str, count: int, count_0_19: int | None = None) -> Edit:
    """`device="cuda"` / `device='cuda'` keyword -> CPU fallback."""
    return Edit(
        path=path,
        pattern=r"device=(['\"])cuda\1",
        repl=r"device=(\1cuda\1 if torch.cuda.is_available() else \1cpu\1)",
        count=count,
        count_0_19=count_0_19,
    )


def _current_device(path: str, count: int, count_0_19: int | None = None) -> Edit:
    return Edit(
        path=path, pattern=r"torch\.cuda\.current_device\(\)", repl=f"({CUR_DEV})", count=count,
        count_0_19=count_0_19,
    )


_RNG_GET = '''    This function is adapted from torch.cuda.random.get_rng_state()"""
'''
_RNG_SET = '''    major performance issues for +4 GPU cases.
    """
'''

DIFFS: dict[str, list[Edit]] = {
    "current_device": [
        _current_device("utils.py", 2, 13),  # 0.19: also CP/THD batch helpers, :2189-2300
        _current_device("tensor_parallel/layers.py", 8),
        _current_device("tensor_parallel/mappings.py", 5),
        _current_device("pipeline_parallel/p2p_communication.py", 6),
        _current_device("distributed/param_and_grad_buffer.py", 3),
        _current_device("optimizer/distrib_optimizer.py", 2),
        _current_device("dist_checkpointing/strategies/state_dict_saver.py", 1),
        _current_device("timers.py", 1),
    ],
    "causal_mask": [_literal("transformer/utils.py", 2)],
    "rng": [
        Edit(
            path="tensor_parallel/random.py",
            pattern=re.escape(_RNG_GET),
            count=1,
            repl=_RNG_GET + "    if not torch.cuda.is_available():\n"
            "        return torch.get_rng_state()\n",
        ),
        Edit(
            path="tensor_parallel/random.py",
            pattern=re.escape(_RNG_SET),
            count=1,
            repl=_RNG_SET + "    if not torch.cuda.is_available():\n"
            "        torch.set_rng_state(new_state)\n        return\n",
        ),
        Edit(
            path="tensor_parallel/random.py",
            count=2,
            pattern=r"= torch\.cuda\.get_rng_state\(\)",
            repl="= _get_cuda_rng_state()",
        ),
        Edit(
            path="tensor_parallel/random.py",
            count=2,
            pattern=r"^( *)torch\.cuda\.manual_seed\((\w+)\)$",
            repl=r"\1torch.cuda.manual_seed(\2)\n\1if not torch.cuda.is_available():\n"
            r"\1    torch.manual_seed(\2)  # torch.cuda.manual_seed is a no-op on CPU builds",
        ),
        Edit(
            path="tensor_parallel/random.py",
            count=1,  # on CPU the two generators are one
            pattern=r"if not torch\.all\(cpu_rng_state == torch\.get_rng_state\(\)\)\.item\(\):",
            repl="if torch.cuda.is_available() and not torch.all(\n"
            "                cpu_rng_state == torch.get_rng_state()\n            ).item():",
        ),
    ],
    "cuda_sync": [
        _sync("pipeline_parallel/p2p_communication.py", 2),
        _sync("dist_checkpointing/strategies/filesystem_async.py", 1),
        _sync("dist_checkpointing/strategies/fully_parallel.py", 2),
        _sync("timers.py", 2),
    ],
    "cuda_literals": [
        _literal("pipeline_parallel/schedules.py", 3),
        _literal("optimizer/optimizer.py", 4, 5),  # 0.19: + has_grad_norm_group, :315
        _literal("optimizer/clip_grads.py", 5),
        _literal("utils.py", 6, 1),  # 0.19: only local_multi_tensor_l2_norm is left
        _literal("optimizer/grad_scaler.py", 4),
        _literal("tensor_parallel/data.py", 1),
        _literal("dist_checkpointing/strategies/state_dict_saver.py", 1),
        _literal("dist_checkpointing/exchange_utils.py", 3),
        _literal("rerun_state_machine.py", 2),
    ],
    "tensor_cuda": [
        Edit(
            path="models/common/language_module/language_module.py",
            count=1,
            pattern=r"^( *)weight\.data = weight\.data\.cuda\(\)$",
            repl=r"\1if torch.cuda.is_available():\n\1    weight.data = weight.data.cuda()",
        ),
    ],
    "type_alias": [
        Edit(
            path="optimizer/clip_grads.py",
            count=1,
            pattern=r"param\.grad\.type\(\) == 'torch\.cuda\.FloatTensor'",
            repl="param.grad.dtype == torch.float32",
        ),
        *[
            Edit(
                path=p,
                count=n,
                pattern=r"(\w+)\.type\(\) in \['torch\.cuda\.HalfTensor', "
                r"'torch\.cuda\.BFloat16Tensor'\]",
                repl=r"\1.dtype in (torch.float16, torch.bfloat16)",
            )
            for p, n in (("optimizer/distrib_optimizer.py", 2), ("optimizer/optimizer.py", 1))
        ],
        *[
            Edit(
                path=p,
                count=1,
                pattern=r"(\w+)\.type\(\) == 'torch\.cuda\.FloatTensor'",
                repl=r"\1.dtype == torch.float32",
            )
            for p in ("optimizer/distrib_optimizer.py", "optimizer/optimizer.py")
        ],
    ],
    "cuda_streams": [
        Edit(
            path="distributed/distributed_data_parallel.py",
            count=1,
            pattern=r"= torch\.cuda\.Stream\(device=torch\.cuda\.current_device\(\)\)$",
            repl="= (\n                    torch.cuda.Stream(device=torch.cuda.current_device())\n"
            "                    if torch.cuda.is_available()\n                    else None\n"
            "                )",
        ),
        Edit(
            path="distributed/param_and_grad_buffer.py",
            count=1,
            pattern=r"and self\.ddp_config\.overlap_grad_reduce\n        \):",
            repl="and self.ddp_config.overlap_grad_reduce\n"
            "            and self.communication_stream is not None\n        ):",
        ),
        Edit(
            path="distributed/param_and_grad_buffer.py",
            count=1,  # 0.16 default_stream(), 0.19 current_stream()
            pattern=r"^( *)torch\.cuda\.(default|current)_stream\(\)"
            r"\.wait_stream\(self\.communication_stream\)$",
            repl=r"\1if self.communication_stream is not None:\n"
            r"\1    torch.cuda.\2_stream().wait_stream(self.communication_stream)",
        ),
        Edit(  # 0.19 :632, every start_grad_sync: wait for CUDA-graph wgrad events
            path="distributed/param_and_grad_buffer.py",
            count=0,
            count_0_19=1,
            pattern=r"^( *)current_stream = torch\.cuda\.current_stream\(\)$",
            repl=r"\1current_stream = (\n\1    torch.cuda.current_stream() if "
            r"torch.cuda.is_available() else None\n\1)  # no CUDA graphs on CPU: never waited on",
        ),
    ],
    "mla_local_attention": [
        Edit(
            path="transformer/dot_product_attention.py",
            count=1,
            pattern=r"^(        pg_collection: Optional\[ProcessGroupCollection\] = None,\n)"
            r"(    \):)",
            repl=r"\1        k_channels: Optional[int] = None,\n"
            r"        v_channels: Optional[int] = None,\n\2",
        ),
        Edit(
            path="transformer/dot_product_attention.py",
            count=1,
            pattern=r"^        projection_size = self\.config\.kv_channels \* "
            r"self\.config\.num_attention_heads$",
            repl="        # MLA (multi_latent_attention.py:155-166) gives its own q/k and v head "
            "widths\n"
            "        k_channels = k_channels or self.config.kv_channels\n"
            "        v_channels = v_channels or self.config.kv_channels\n"
            "        projection_size = v_channels * self.config.num_attention_heads",
        ),
        Edit(
            path="transformer/dot_product_attention.py",
            count=1,
            pattern=r"^        self\.hidden_size_per_attention_head = divide\(projection_size, "
            r"config\.num_attention_heads\)$",
            repl="        self.hidden_size_per_attention_head = k_channels",
        ),
        Edit(
            path="transformer/multi_latent_attention.py",
            count=1,
            pattern=r"^            HAVE_TE\n"
            r"            and isinstance\(self\.linear_proj, TELinear\)$",
            repl="            HAVE_TE\n"
            "            and isinstance(TELinear, type)  # a MagicMock without TE\n"
            "            and isinstance(self.linear_proj, TELinear)",
        ),
    ],
    "te_gemm_stub": [
        Edit(
            path="transformer/moe/moe_utils.py",
            count=1,
            pattern=r"^except ImportError:\n    HAVE_TE = False$",
            repl="except ImportError:\n    HAVE_TE = False\n"
            "    te_general_gemm = None  # RouterGatingLinearFunction falls back to torch.mm",
        ),
    ],
    "stream_events": [
        Edit(
            path="transformer/moe/token_dispatcher.py",
            count=1,
            pattern=r"= torch\.cuda\.Stream\(\)$",
            repl="= (\n                torch.cuda.Stream() if torch.cuda.is_available() else None\n"
            "            )",
        ),
        Edit(
            path="transformer/moe/token_dispatcher.py",
            count=1,
            pattern=r"on_side_stream = torch\.cuda\.current_stream\(\) != "
            r"self\.cuda_dtoh_stream$",
            repl="on_side_stream = (\n                    self.cuda_dtoh_stream is not None\n"
            "                    and torch.cuda.current_stream() != self.cuda_dtoh_stream\n"
            "                )",
        ),
        Edit(
            path="transformer/moe/token_dispatcher.py",
            count=1,
            pattern=r"^( *)self\.d2h_event = self\.cuda_dtoh_stream\.record_event\(\)$",
            repl=r"\1self.d2h_event = (\n\1    self.cuda_dtoh_stream.record_event()\n"
            r"\1    if self.cuda_dtoh_stream is not None\n\1    else None\n\1)",
        ),
        Edit(
            path="transformer/moe/token_dispatcher.py",
            count=1,
            pattern=r"^( *)self\.d2h_event\.synchronize\(\)$",
            repl=r"\1if self.d2h_event is not None:\n\1    self.d2h_event.synchronize()",
        ),
    ],
    "host_splits": [
        Edit(
            path="transformer/moe/moe_utils.py",
            count=1,
            pattern=r"^(    )if torch\.is_tensor\(tensor\) and tensor\.is_cuda:$",
            repl=r"\1if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:\n"
            r"\1    return tensor.numpy()  # split sizes for all_to_all_single on CPU\n"
            r"\1if torch.is_tensor(tensor) and tensor.is_cuda:",
        ),
    ],
    "uneven_gather": [
        Edit(
            path="tensor_parallel/mappings.py",
            count=1,
            pattern=r"^( *)torch\.distributed\.all_gather\(output_tensor_list, input_, "
            r"group=group\)$",
            repl=r"\1if input_.is_cuda:\n"
            r"\1    torch.distributed.all_gather(output_tensor_list, input_, group=group)\n"
            r"\1else:  # gloo: equal sizes only; pad every part to the largest\n"
            r"\1    rows = max(output_split_sizes)\n"
            r"\1    padded = input_.new_zeros((rows, *dim_size[1:]))\n"
            r"\1    padded[: input_.shape[0]] = input_\n"
            r"\1    parts = [torch.empty_like(padded) for _ in output_split_sizes]\n"
            r"\1    torch.distributed.all_gather(parts, padded, group=group)\n"
            r"\1    for out, part, n in zip(output_tensor_list, parts, output_split_sizes):\n"
            r"\1        out.copy_(part[:n])",
        ),
        Edit(
            path="tensor_parallel/mappings.py",
            count=1,
            pattern=r"^( *)torch\.distributed\.reduce_scatter\(output, input_tensor_list, "
            r"group=group\)$",
            repl=r"\1if input_.is_cuda:\n"
            r"\1    torch.distributed.reduce_scatter(output, input_tensor_list, group=group)\n"
            r"\1else:  # gloo has no list reduce-scatter: all-reduce, keep this rank's rows\n"
            r"\1    full = input_.contiguous().clone()\n"
            r"\1    torch.distributed.all_reduce(full, group=group)\n"
            r"\1    output.copy_(torch.split(full, input_split_sizes, dim=0)[rank])",
        ),
    ],
}
"""Diff name (= cpu_compat patch name) -> edits."""


def for_this_version() -> list[str]:
    """The patches the installed megatron-core needs, each with a diff here."""
    return [name for name in DIFFS if PATCHES[name].applies_to(VERSION)]


def render(name: str) -> str:
    """The unified diff for one patch, against the installed megatron-core."""
    by_file: dict[str, list[Edit]] = {}
    for edit in DIFFS[name]:
        if edit.expected():
            by_file.setdefault(edit.path, []).append(edit)
    chunks = [
        f"# {name}: source-level twin of megatron_ext cpu_compat patch {name!r}.\n"
        f"# Against megatron-core {VERSION} (patch versions {PATCHES[name].versions}); "
        f"from site-packages: patch -p1 < {name}.diff\n"
        "# Generated by patches/make_diffs.py; rationale in patches/README.md.\n"
    ]
    for path, edits in by_file.items():
        rel = f"megatron/core/{path}"
        old = (SITE_PACKAGES / rel).read_text()
        new = old
        for edit in edits:
            new, found = re.subn(edit.pattern, edit.repl, new, flags=re.MULTILINE)
            if found != edit.expected():
                raise RuntimeError(
                    f"{name}: {rel}: {edit.pattern!r} matched {found}, "
                    f"expected {edit.expected()} (not megatron-core {LINE}.x?)"
                )
        chunks.append(_diff_u(rel, old, new))
    return "".join(chunks)


def _diff_u(rel: str, old: str, new: str) -> str:
    """`diff -u` of two copies in a temp dir, labelled a/<rel> and b/<rel> (for patch -p1)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old").write_text(old)
        (Path(tmp) / "new").write_text(new)
        result = subprocess.run(
            ["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}", "old", "new"],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )
    if result.returncode != 1:  # 1 = files differ; 0 would mean an edit changed nothing
        raise RuntimeError(f"diff -u {rel} exited {result.returncode}: {result.stderr}")
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed diff is stale")
    args = parser.parse_args(argv)
    stale = []
    PATCH_DIR.mkdir(exist_ok=True)
    for name in for_this_version():
        target = PATCH_DIR / f"{name}.diff"
        text = render(name)
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
    if stale:
        print(f"stale diffs: {stale}; run python patches/make_diffs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
