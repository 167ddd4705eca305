"""Megatron-LM command-line flags as data and pure functions: the parser, cross-flag checks,
plan -> flags (emit) and flags -> plan (to_plan). Imports neither torch nor megatron."""
