"""FlexSP on megatron-core: packed Ulysses core attention and the per-sequence GPT model."""
