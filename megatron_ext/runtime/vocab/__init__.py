"""Vocabulary parallelism (Yeung et al., MLSys 2025): math, communication and pass schedule.

See megatron_ext/runtime/vocab_parallel.py for the public API."""
