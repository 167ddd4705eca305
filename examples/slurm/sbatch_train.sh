#!/bin/bash
# Multi-node training with a searched layout: `megatron-ext search` -> plan.json ->
# `megatron-ext args` (one flag per line) -> `megatron-ext launch` examples/pretrain_gpt.py on
# every node (torchrun's command line; it checks the flags, the plan on the allocation's world
# size and the checkpoint to --load in one process per node, then becomes torchrun).
#
#   sbatch --nodes 4 examples/slurm/sbatch_train.sh
#   IMAGE=/shared/megatron-ext.sqsh MODEL=llama3-8b DATA_PATH=/data/corpus_text_document \
#     TOKENIZER_MODEL=/data/llama3 sbatch --nodes 2 examples/slurm/sbatch_train.sh
#
# One Slurm task per node (pyxis/enroot container); torchrun starts GPUS_PER_NODE ranks per node
# and rendezvouses at the first node of the allocation (Megatron-LM's Slurm recipe).
# IMAGE=none runs without a container: the tasks use the submitting shell's environment
# (a virtualenv or module on PATH) in WORKDIR, by default the directory sbatch ran in.
#
# Preemption: 5 minutes before the time limit (--signal) Slurm sends SIGTERM to every process of
# the job's steps; the ranks (--exit-signal-handler) finish the step in flight, save and exit 0.
# `scontrol requeue <jobid>` (or the scheduler's own preemption requeue, --requeue) runs this
# script again under the same job id: same RUN_DIR, same plan, training resumes from the newest
# checkpoint, and the log is appended (--open-mode=append).
#SBATCH --job-name=megatron-ext-train
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=TERM@300
#SBATCH --open-mode=append
set -euo pipefail
fail() { echo "sbatch_train.sh: error: $*" >&2; exit 2; }
echo "job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?}, start ${SLURM_RESTART_COUNT:-0}"

# ---- site settings (environment overrides) ----------------------------------------------------
IMAGE=${IMAGE:-megatron-ext:latest}          # pyxis: a registry image or an enroot .sqsh file;
                                              # none: no container
MOUNTS=${MOUNTS:-/lustre:/lustre}             # --container-mounts
if [[ "$IMAGE" == none ]]; then
    WORKDIR=${WORKDIR:-$PWD}                  # the checkout the tasks run in
else
    WORKDIR=${WORKDIR:-/opt/megatron_ext}     # the package inside the image (Dockerfile)
fi
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
# More pretrain_gpt.py flags, split at whitespace and passed last (the last of a repeated flag
# wins, as in Megatron-LM), e.g. EXTRA_ARGS="--cpu --transformer-impl local" for CPU ranks.
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
read -r -a SEARCH_EXTRA <<< "${SEARCH_ARGS:-}"  # more `megatron-ext search` options, likewise

NNODES=${SLURM_JOB_NUM_NODES:-1}
# (pipefail off inside: head exiting early must not fail the job)
MASTER_ADDR=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
CONTAINER=(--container-image="$IMAGE" --container-mounts="$MOUNTS" --container-workdir="$WORKDIR")
[[ "$IMAGE" == none ]] && CONTAINER=(--chdir="$WORKDIR")

# ---- 1. search the layout (one task; CPU only), unless PLAN_FILE names an existing plan --------
# A requeued job (same RUN_DIR) keeps the plan its checkpoints were written under.
PLAN=${PLAN_FILE:-$RUN_DIR/plan.json}
if [[ -n "${PLAN_FILE:-}" ]]; then
    [[ -r "$PLAN" ]] || fail "PLAN_FILE=$PLAN: no such file; give a plan from megatron-ext search"
elif [[ -s "$PLAN" ]]; then
    echo "reusing $PLAN (the plan this job trained with before it was requeued)"
else
    MODEL_ARGS=(--model "$MODEL")
    [[ -n "${MODEL_CONFIG:-}" ]] && MODEL_ARGS=(--model-config "$MODEL_CONFIG")
    CLUSTER_ARGS=(--cluster "$CLUSTER")
    [[ -n "${CLUSTER_PROFILE:-}" ]] && CLUSTER_ARGS=(--cluster-profile "$CLUSTER_PROFILE")
    srun --nodes=1 --ntasks=1 --overlap "${CONTAINER[@]}" \
        megatron-ext search "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" --nodes "$NNODES" \
        --global-batch-size "$GLOBAL_BATCH_SIZE" --seq-length "$SEQ_LENGTH" "${SEARCH_EXTRA[@]}" \
        --out "$PLAN" > /dev/null  # the report goes to the log (stderr); stdout repeats step 2
fi

# ---- checks before any rank starts: one line, exit 2 -------------------------------------------
PLAN_WORLD=$(grep -o '"world_size" *: *[0-9]*' "$PLAN" | grep -o '[0-9]*$' || true)
(( ${PLAN_WORLD:-0} == NNODES * GPUS_PER_NODE )) || fail "$PLAN is for ${PLAN_WORLD:-?} ranks;" \
    "this allocation has $NNODES node(s) x GPUS_PER_NODE=$GPUS_PER_NODE = $((NNODES * GPUS_PER_NODE));" \
    "search for this allocation (unset PLAN_FILE) or change --nodes / GPUS_PER_NODE"
# The data as every node sees it (inside the container: MOUNTS): the indexed dataset's two files.
MISSING=$(srun --ntasks-per-node=1 --overlap "${CONTAINER[@]}" bash -c \
    'for f in "$1.bin" "$1.idx"; do [[ -r $f ]] || echo "${SLURMD_NODENAME:-$(hostname)}: $f"; done' \
    _ "$DATA_PATH")
[[ -z "$MISSING" ]] || fail "DATA_PATH=$DATA_PATH: cannot read ${MISSING//$'\n'/, } inside the" \
    "job; check the path and MOUNTS=$MOUNTS"

# ---- 2. the plan as Megatron-LM flags, one argv token per line ----------------------------------
# mapfile keeps tokens such as layout strings ("E|(t|)*3") intact; $( ) alone would split and
# glob them.
ARGS_TEXT=$(srun --nodes=1 --ntasks=1 --overlap "${CONTAINER[@]}" megatron-ext args "$PLAN")
mapfile -t PLAN_ARGS <<< "$ARGS_TEXT"
[[ -n "$ARGS_TEXT" ]] || fail "megatron-ext args printed nothing for $PLAN"

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
CHECKPOINT_ARGS=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000
                 --exit-signal-handler)
LOGGING_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10
              --tensorboard-dir "$RUN_DIR/tensorboard")
LAUNCH_ARGS=(--nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --rdzv_backend c10d
             --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${SLURM_JOB_ID:-0}")

# A bad flag, a plan that does not fit this world size or a checkpoint that does not load under it
# is one line from `megatron-ext launch` (exit 2) before any rank starts; the job fails with it.
# Slurm signals every process of the step, torchrun's agent too. The agent would forward SIGTERM,
# kill ranks still saving after 30 s and exit 1; it ignores SIGTERM instead (trap '' survives
# launch's exec of torchrun; SIGTERM is not in torchrun's --signals-to-handle) and exits 0 once
# the ranks have saved and exited 0.
export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT
echo "torchrun: $NNODES node(s) x $GPUS_PER_NODE ranks, rendezvous at $MASTER_ADDR:$MASTER_PORT"
srun --ntasks-per-node=1 --export="$EXPORTS" "${CONTAINER[@]}" \
    bash -c 'trap "" TERM; exec "$@"' launch \
    megatron-ext launch "${LAUNCH_ARGS[@]}" examples/pretrain_gpt.py \
    "${PLAN_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "${EXTRA[@]}"
