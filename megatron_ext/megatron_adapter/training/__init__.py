"""The drop-in training loop on megatron-core parts: data, tokenizers, model, loop, checkpoints.

`examples/pretrain_gpt.py` calls `entry.main(argv)`: flags checked, then `pretrain.launch`.
Everything here is megatron-core 0.16.1 plus this package; nothing from Megatron-LM's
`megatron.training`.
"""
