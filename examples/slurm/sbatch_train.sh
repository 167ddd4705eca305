#!/bin/bash
# Multi-node training with a searched layout: `megatron-ext search` -> plan.json ->
# `megatron-ext args` (one flag per line) -> torchrun examples/pretrain_gpt.py on every node.
#
#   sbatch --nodes 4 examples/slurm/sbatch_train.sh
#   IMAGE=/shared/megatron-ext.sqsh MODEL=llama3-8b DATA_PATH=/data/corpus_text_document \
#     TOKENIZER_MODEL=/data/llama3 sbatch --nodes 2 examples/slurm/sbatch_train.sh
#
# One Slurm task per node (pyxis/enroot container); torchrun starts GPUS_PER_NODE ranks per node
# and rendezvouses at the first node of the allocation (Megatron-LM's Slurm recipe).
#SBATCH --job-name=megatron-ext-train
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail

# ---- site settings (environment overrides) ----------------------------------------------------
IMAGE=${IMAGE:-megatron-ext:latest}          # pyxis: a registry image or an enroot .sqsh file
MOUNTS=${MOUNTS:-/lustre:/lustre}             # --container-mounts
WORKDIR=${WORKDIR:-/opt/megatron_ext}         # the package inside the image (Dockerfile)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}
RUN_DIR=${RUN_DIR:-$PWD/runs/$SLURM_JOB_ID}   # plan, checkpoints, TensorBoard
mkdir -p "$RUN_DIR"

# ---- what to train ------------------------------------------------------------------------------
MODEL=${MODEL:-llama2-7b}                     # preset, or MODEL_CONFIG=config.json
CLUSTER=${CLUSTER:-dgx-h100}                  # preset, or CLUSTER_PROFILE from sbatch_profile.sh
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-512}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
DATA_PATH=${DATA_PATH:-/lustre/data/corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-/lustre/tokenizers/llama2}

NNODES=${SLURM_JOB_NUM_NODES:-1}
# (pipefail off inside: head exiting early must not fail the job)
MASTER_ADDR=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
CONTAINER=(--container-image="$IMAGE" --container-mounts="$MOUNTS" --container-workdir="$WORKDIR")

# ---- 1. search the layout (one task; CPU only), unless PLAN_FILE names an existing plan --------
PLAN=${PLAN_FILE:-$RUN_DIR/plan.json}
if [[ -z "${PLAN_FILE:-}" ]]; then
    MODEL_ARGS=(--model "$MODEL")
    [[ -n "${MODEL_CONFIG:-}" ]] && MODEL_ARGS=(--model-config "$MODEL_CONFIG")
    CLUSTER_ARGS=(--cluster "$CLUSTER")
    [[ -n "${CLUSTER_PROFILE:-}" ]] && CLUSTER_ARGS=(--cluster-profile "$CLUSTER_PROFILE")
    srun --nodes=1 --ntasks=1 "${CONTAINER[@]}" \
        megatron-ext search "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" --nodes "$NNODES" \
        --global-batch-size "$GLOBAL_BATCH_SIZE" --seq-length "$SEQ_LENGTH" --out "$PLAN"
fi

# ---- 2. the plan as Megatron-LM flags, one argv token per line ----------------------------------
# mapfile keeps tokens such as layout strings ("E|(t|)*3") intact; $( ) would split and glob them.
mapfile -t PLAN_ARGS < <(srun --nodes=1 --ntasks=1 "${CONTAINER[@]}" megatron-ext args "$PLAN")
if (( ${#PLAN_ARGS[@]} == 0 )); then
    echo "megatron-ext args printed nothing for $PLAN" >&2
    exit 2
fi

# ---- CUDA_DEVICE_MAX_CONNECTIONS, per feature ---------------------------------------------------
# 1: tensor/sequence/context parallelism need the kernel order Megatron-LM relies on to overlap
#    TP/CP communication with compute (Megatron-LM sets it for TP>1 or CP>1 on Hopper).
# unset: torch FSDP2 (ZeRO-3) refuses 1; its streams need more than one connection.
# 8: vocabulary parallelism runs its vocabulary passes' collectives on side streams that must
#    overlap with the pipeline (the reference implementation's setting).
connections=""
has_flag() { local f; for f in "${PLAN_ARGS[@]}"; do [[ "$f" == "$1" ]] && return 0; done; return 1; }
flag_value() { local i; for ((i = 0; i < ${#PLAN_ARGS[@]} - 1; i++)); do
    [[ "${PLAN_ARGS[i]}" == "$1" ]] && { echo "${PLAN_ARGS[i+1]}"; return; }; done; echo 1; }
if has_flag --use-torch-fsdp2; then
    connections=""
elif has_flag --vocab-parallel; then
    connections=8
elif (( $(flag_value --tensor-model-parallel-size) > 1 || $(flag_value --context-parallel-size) > 1 )) \
        || has_flag --strategy-config; then
    connections=1
fi
EXPORTS=ALL
[[ -n "$connections" ]] && EXPORTS="ALL,CUDA_DEVICE_MAX_CONNECTIONS=$connections"

# ---- 3. train: flags grouped as Megatron-LM's examples ------------------------------------------
DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL")
TRAINING_ARGS=(--train-iters "${TRAIN_ITERS:-10000}" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
               --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9
               --adam-beta2 0.95)
CHECKPOINT_ARGS=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000)
LOGGING_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10
              --tensorboard-dir "$RUN_DIR/tensorboard")
LAUNCH_ARGS=(--nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --rdzv_backend c10d
             --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${SLURM_JOB_ID:-0}")

srun --ntasks-per-node=1 --export="$EXPORTS" "${CONTAINER[@]}" \
    python -m torch.distributed.run "${LAUNCH_ARGS[@]}" examples/pretrain_gpt.py \
    "${PLAN_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" \
    "${LOGGING_ARGS[@]}"
