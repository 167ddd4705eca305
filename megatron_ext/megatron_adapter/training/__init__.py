"""The drop-in training loop on megatron-core parts: data, tokenizers, model, loop, checkpoints.

`examples/pretrain_gpt.py` parses Megatron-LM flags and calls `pretrain.main(argv)`. Everything
here is megatron-core 0.16.1 plus this package; nothing from Megatron-LM's `megatron.training`.
"""
