"""megatron_ext: layerwise heterogeneous parallelism, strategy search, vocabulary parallelism and
flexible sequence parallelism on Megatron-Core.

`pip install megatron_ext` installs the planner CLI alone (search, evaluate, args, plan-from-args,
flags, validate, flexsp plan): numpy and scipy, no torch, no megatron-core, so it never changes
the Megatron of the environment it is installed into. `megatron_ext[train]` adds the runtime
(pretrain_gpt.py, profile) with megatron-core as a supported range (megatron_adapter/
compat_versions.py says which)."""

from setuptools import find_packages, setup

# The runtime (`pip install megatron_ext[train]`). megatron-core is a range, never pinned: the
# upper bound is the first version not yet supported (megatron_adapter/compat_versions.py
# SUPPORTED; the runtime refuses others in one line before any process group).
TRAIN = [
    "megatron-core>=0.16.1,<0.20",
    # torch is required but not pinned: install the build you want first (CPU: torch==2.13.0).
    "torch>=2.6",
    "einops",  # megatron-core's HyperCommGrid needs it but does not declare it
    "psutil",  # megatron-core's torch_dist checkpoint writer needs it but does not declare it
    "tokenizers>=0.20",  # offline GPT-2 BPE / tokenizer.json without transformers or a hub
]

setup(
    name="megatron_ext",
    version="0.1.0",
    description="Searched per-layer parallel layouts for Megatron-Core training",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    # Megatron-LM's flag listing per supported version, read by flags/catalog.py
    package_data={
        "megatron_ext.flags": ["megatron_lm_core_v*_flags.json"],
        # the prediction intervals' residual table (tools/bench_published.py --write-residuals)
        # and the A100 nodes' measured all-reduce times (planner/cost/measured_nccl.py)
        "megatron_ext.planner.cost": ["residuals_a100.json", "nccl_a100.json"],
    },
    # the planner CLI: nothing here may pull torch or megatron-core (tests/unit/test_planner_install.py)
    install_requires=[
        "numpy",
        "scipy>=1.9",  # HiGHS MILP for the exact FlexSP planner
    ],
    extras_require={
        "train": TRAIN,
        "gpu": [*TRAIN, "transformer-engine[pytorch]", "flash-attn"],
        "plot": ["matplotlib"],
        # transformers: the HuggingFace config tests build configs with the real library (it
        # does not require torch, so installing it keeps the torch build already there)
        "dev": ["pytest", "hypothesis", "ruff", "mypy", "transformers>=5,<6"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
