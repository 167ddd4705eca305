#!/usr/bin/env bash
# The install steps of the root Dockerfile, in order. The Dockerfile runs exactly this script
# (after FROM and COPY); CI runs it too (tests/unit/test_slurm_docker.py), so every command the
# image build runs is exercised on a machine without Docker, except pulling the base image.
#
# Usage: tools/docker_steps.sh REPO_DIR
#   PYTHON=...         the interpreter (default python)
#   MEGATRON_CORE=...  the megatron-core requirement (default: the image's, megatron-core 0.19.x,
#                      whose wheels are for Python 3.12 only, the NGC base's Python). The test
#                      passes the version already installed, so a CI leg never changes its own.
set -euo pipefail

REPO_DIR=${1:?usage: tools/docker_steps.sh REPO_DIR}
PYTHON=${PYTHON:-python}
MEGATRON_CORE=${MEGATRON_CORE:-megatron-core>=0.19,<0.20}

# 1. megatron-core, in the supported range. The NGC base image already carries torch (CUDA),
#    transformer-engine, apex and flash-attn; megatron-core declares only torch/numpy/packaging,
#    so nothing of the image is replaced. `tokenizers` reads GPT-2 vocab/merges and
#    tokenizer.json offline.
"$PYTHON" -m pip install --no-cache-dir "$MEGATRON_CORE" "tokenizers>=0.20"

# 2. this package with its runtime extra, editable from the copied source (the plain install is
#    the planner alone; [train] adds einops, psutil, tokenizers and checks megatron-core's range).
"$PYTHON" -m pip install --no-cache-dir -e "$REPO_DIR[train]"

# 3. smoke check: the entry points import, the runtime accepts the installed megatron-core, and
#    the CLI answers.
"$PYTHON" -c "import megatron.core, megatron_ext, tokenizers; print('megatron-core', megatron.core.__version__)"
"$PYTHON" -c "
import sys
from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.compat_versions import check_megatron_core
try:
    check_megatron_core()
except PlanError as e:
    sys.exit(f'docker_steps: {e}')"
"$PYTHON" -m megatron_ext.cli --help > /dev/null
"$PYTHON" "$REPO_DIR/tools/preprocess_data.py" --help > /dev/null
echo "docker_steps: OK"
