"""Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary
Parallelism", MLSys 2025): the device-agnostic torch side.

The input embedding and the output layer are split over all pipeline x tensor-parallel ranks
(padded; padded logits never enter the softmax). Every rank runs, per micro-batch, the passes
IF/IB (input embedding forward / backward) and S/T (output layer forward + fused input-gradient
GEMM / weight gradient); the softmax cross-entropy is reduced with the online max/sum-exp
rescaling, with one communication barrier (algorithm 1, p+1 micro-batches of activations) or two
(algorithm 2, p+2).

Modules: output_layer / input_layer (math), comm (groups and asynchronous-collective helpers),
passes (per-iteration runner), profiling (peak live-tensor bytes for memory measurements).
The torch-free parts live below the runtime: the vocabulary split and the passes' activation
layout in megatron_ext/geometry/ (vocab_partition, vocab), the pass order, placement,
simulation and analytic pass costs in megatron_ext/planner/vocab/. The Megatron-facing
schedule is megatron_ext/megatron_adapter/vocab/schedule.py.
"""
