#!/usr/bin/env bash
# The install steps of the root Dockerfile, in order. The Dockerfile runs exactly this script
# (after FROM and COPY); CI runs it too (tests/unit/test_slurm_docker.py), so every command the
# image build runs is exercised on a machine without Docker, except pulling the base image.
#
# Usage: tools/docker_steps.sh REPO_DIR      (PYTHON=... picks the interpreter, default python)
set -euo pipefail

REPO_DIR=${1:?usage: tools/docker_steps.sh REPO_DIR}
PYTHON=${PYTHON:-python}

# 1. megatron-core, pinned. The NGC base image already carries torch (CUDA), transformer-engine,
#    apex and flash-attn; megatron-core declares only torch/numpy/packaging, so nothing of the
#    image is replaced. `tokenizers` reads GPT-2 vocab/merges and tokenizer.json offline.
"$PYTHON" -m pip install --no-cache-dir "megatron-core==0.16.1" "tokenizers>=0.20"

# 2. this package with its runtime extra, editable from the copied source (the plain install is
#    the planner alone; [train] adds einops, psutil, tokenizers and checks megatron-core's range).
"$PYTHON" -m pip install --no-cache-dir -e "$REPO_DIR[train]"

# 3. smoke check: the entry points import and the CLI answers.
"$PYTHON" -c "import megatron.core, megatron_ext, tokenizers; print('megatron-core', megatron.core.__version__)"
"$PYTHON" -m megatron_ext.cli --help > /dev/null
"$PYTHON" "$REPO_DIR/tools/preprocess_data.py" --help > /dev/null
echo "docker_steps: OK"
