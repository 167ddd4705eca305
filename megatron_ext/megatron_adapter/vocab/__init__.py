"""Vocabulary parallelism on megatron-core: stage layers, passes, the 1F1B schedule."""
