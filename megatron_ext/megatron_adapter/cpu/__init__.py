"""megatron-core 0.16.1 on CPU-only torch under gloo: named, opt-in, undoable patches."""
