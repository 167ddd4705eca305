"""megatron_ext: layerwise heterogeneous parallelism, strategy search, vocabulary parallelism and
flexible sequence parallelism on Megatron-Core 0.16.1."""

from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description="Searched per-layer parallel layouts for Megatron-Core training",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    # Megatron-LM core_v0.16.1's flag listing, read by flags/catalog.py
    package_data={
        "megatron_ext.flags": ["megatron_lm_core_v0.16.1_flags.json"],
        # the prediction intervals' residual table (tools/bench_published.py --write-residuals)
        "megatron_ext.planner.cost": ["residuals_a100.json"],
    },
    install_requires=[
        "megatron-core==0.16.1",
        # torch is required but not pinned: install the build you want first (CPU: torch==2.13.0).
        "torch>=2.6",
        "numpy",
        "scipy>=1.9",  # HiGHS MILP for the exact FlexSP planner
        "einops",  # megatron-core's HyperCommGrid needs it but does not declare it
        "psutil",  # megatron-core's torch_dist checkpoint writer needs it but does not declare it
        "tokenizers>=0.20",  # offline GPT-2 BPE / tokenizer.json without transformers or a hub
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
        "plot": ["matplotlib"],
        # transformers: the HuggingFace config tests build configs with the real library (it
        # does not require torch, so installing it keeps the torch build already there)
        "dev": ["pytest", "hypothesis", "ruff", "mypy", "transformers>=5,<6"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
