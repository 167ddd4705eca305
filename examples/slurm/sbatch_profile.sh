#!/bin/bash
# Measure the cluster for the cost model: collective bandwidth/latency curves inside and across
# nodes and the compute/communication overlap slowdown (`megatron-ext profile hardware`).
# The written profile feeds the search:
#
#   sbatch --nodes 2 examples/slurm/sbatch_profile.sh
#   CLUSTER_PROFILE=runs/<jobid>/cluster_profile.json sbatch --nodes 2 examples/slurm/sbatch_train.sh
#
# IMAGE=none runs without a container (as sbatch_train.sh); PROFILE_ARGS adds options of
# `megatron-ext profile hardware` (split at whitespace), e.g. "--max-bytes 1048576 --repeats 3".
#SBATCH --job-name=megatron-ext-profile
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=00:30:00
set -euo pipefail

IMAGE=${IMAGE:-megatron-ext:latest}
MOUNTS=${MOUNTS:-/lustre:/lustre}
if [[ "$IMAGE" == none ]]; then
    WORKDIR=${WORKDIR:-$PWD}
else
    WORKDIR=${WORKDIR:-/opt/megatron_ext}
fi
read -r -a PROFILE_EXTRA <<< "${PROFILE_ARGS:-}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}
RUN_DIR=${RUN_DIR:-$PWD/runs/$SLURM_JOB_ID}
mkdir -p "$RUN_DIR"

NNODES=${SLURM_JOB_NUM_NODES:-1}
# (pipefail off inside: head exiting early must not fail the job)
MASTER_ADDR=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
CONTAINER=(--container-image="$IMAGE" --container-mounts="$MOUNTS" --container-workdir="$WORKDIR")
[[ "$IMAGE" == none ]] && CONTAINER=(--chdir="$WORKDIR")
LAUNCH_ARGS=(--nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --rdzv_backend c10d
             --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${SLURM_JOB_ID:-0}")
# The profiler measures NCCL as training uses it: one connection, as for TP/CP layers.
srun --ntasks-per-node=1 --export=ALL,CUDA_DEVICE_MAX_CONNECTIONS=1 "${CONTAINER[@]}" \
    python -m torch.distributed.run "${LAUNCH_ARGS[@]}" -m megatron_ext.cli \
    profile hardware --out "$RUN_DIR/cluster_profile.json" --ranks-per-node "$GPUS_PER_NODE" \
    "${PROFILE_EXTRA[@]}"
echo "cluster profile: $RUN_DIR/cluster_profile.json" >&2
