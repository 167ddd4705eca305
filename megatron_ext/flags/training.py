"""Megatron-LM pretrain_gpt.py flags for training, data, checkpoints and logging.

Names, defaults, types and choices copy Megatron-LM core_v0.16.1 `megatron/training/arguments.py`
(argument groups training, learning rate, regularization, checkpointing, validation, data,
tokenizer, logging); help texts are shortened. None of these flags shape the parallel layout, so
plan_from_megatron_args ignores them; the drop-in pretrain_gpt.py honours them.
"""

from __future__ import annotations

import argparse
import os
import signal

from megatron_ext.flags.moe import add_moe_training_args


def add_training_groups(parser: argparse.ArgumentParser) -> None:
    _add_optimizer(parser)
    _add_learning_rate(parser)
    _add_run_length(parser)
    _add_checkpointing(parser)
    _add_data(parser)
    _add_tokenizer(parser)
    _add_logging(parser)
    _add_kernels(parser)
    add_moe_training_args(parser)


def _add_optimizer(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer and regularization")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon", "dist_muon"],
                   help="optimizer (muon variants are not supported by megatron_ext)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="L2 weight decay")
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0, help="global L2 gradient clipping")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true", default=False)
    g.add_argument("--overlap-param-gather", action="store_true", default=False)
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron FSDP; with --data-parallel-sharding-strategy "
                   "optim_grads_params it is the plan's zero=3")
    g.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad")


def _add_learning_rate(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true")


def _signal(name: str) -> signal.Signals:
    """Megatron-LM's enum_type_handler for --exit-signal: a signal name such as SIGTERM."""
    try:
        return signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a signal name (e.g. SIGTERM, "
                                         "SIGUSR1)") from None


def _add_run_length(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run length and evaluation")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="plan and cost model use the final --global-batch-size")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (and SIGINT): save at the end of the current step, "
                        "exit 0")
    g.add_argument("--exit-signal", type=_signal, default="SIGTERM",  # argparse converts it
                   help="signal --exit-signal-handler catches, e.g. SIGTERM (default), SIGUSR1")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--skip-train", action="store_true", default=False)


def _add_checkpointing(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration from --load instead of the tracker file's")
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"])
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true")
    g.add_argument("--async-save", action="store_true", default=False)
    g.add_argument("--use-persistent-ckpt-worker", action="store_true", default=False)
    g.add_argument("--ckpt-assume-constant-structure", action="store_true", default=False)


def _add_data(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix, or weight prefix pairs, of .bin/.idx datasets")
    g.add_argument("--split", type=str, default=None, help="e.g. 969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--num-dataset-builder-threads", type=int, default=1)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic", "external"])


def _add_tokenizer(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", type=str, default=None, choices=[
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
        "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer", "NullTokenizer",
        "NullMultimodalTokenizer", "SFTTokenizer",
    ])
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)


def _add_logging(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=range(3))
    g.add_argument("--logging-level", type=int, default=None,
                   help="root logger level on every rank, as Megatron-LM (20 shows megatron-core's "
                   "configuration dumps); default: rank 0's training log and warnings only")


def _add_kernels(parser: argparse.ArgumentParser) -> None:
    """Implementation and fusion switches: they change speed, not the maths or the layout."""
    g = parser.add_argument_group("kernels and implementation")
    g.add_argument("--transformer-impl", default="transformer_engine",
                   choices=["local", "transformer_engine", "inference_optimized"])
    g.add_argument("--attention-backend", default="auto",
                   choices=["flash", "fused", "unfused", "local", "auto"])
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None)
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--empty-unused-memory-level", default=0, type=int, choices=[0, 1, 2])
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce",
                   help="deprecated in Megatron-LM and ignored there too")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                   help="deprecated in Megatron-LM and ignored there too")
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local-rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")),
                   help="set by torch.distributed.launch (default $LOCAL_RANK, as Megatron-LM)")
    g.add_argument("--no-overlap-p2p-communication", action="store_false",
                   dest="overlap_p2p_comm",
                   help="interleaved pipelines: Megatron-LM then batches point-to-point and "
                   "needs pp > 2 (checked); the layerwise runtime always sends unbatched and "
                   "waits, so it changes no result")
