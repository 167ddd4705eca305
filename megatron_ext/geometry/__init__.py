"""Plan geometry (no torch): which ranks hold which part of an activation or of the vocabulary.

Derived from the plan alone, so the planner, `evaluate` and the runtime read the same answer.
Modules: activation (`ActivationLayout`: a `[s, b, h]` activation over the ranks of one pipeline
stage), stages (the layouts a plan uses per stage and chunk, stage boundaries, message shapes),
vocab (the vocabulary passes' layout under vocab.mode vocab_parallel), vocab_partition (the
padded split of the vocabulary rows over the vocabulary-parallel group).
"""
