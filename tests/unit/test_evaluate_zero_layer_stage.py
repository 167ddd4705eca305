"""The evaluator scores a stage with no transformer layer (vocabulary work only).

Such layouts are what layer redistribution does at large vocabularies (the paper's "redis"
baseline puts 0 layers on the last stage at 256k); plan files forbid empty stages, but the
cost model is used on them by benchmarks and comparisons.
"""

from __future__ import annotations

from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset


def test_a_stage_without_layers_costs_its_vocabulary_work_only() -> None:
    training = TrainingSpec(global_batch_size=64, seq_length=4096)
    cm = CostModel(model_preset("llama3-8b"), cluster_preset("dgx-h100", num_nodes=1), training)
    layers = [LayerStrategy(tp=1, dp=2)] * 32
    empty_last = evaluate(cm, PlanLayout(pp=4, stages=[(0, 11), (11, 22), (22, 32), (32, 32)],
                          layers=layers, vocab=VocabStrategy(tp=1), micro_batch_size=2))
    with_layer = evaluate(cm, PlanLayout(pp=4, stages=[(0, 11), (11, 21), (21, 31), (31, 32)],
                          layers=layers, vocab=VocabStrategy(tp=1), micro_batch_size=2))
    # The last stage keeps the output layer (busy, holds memory) but sheds a layer's work.
    assert 0 < empty_last.stage_busy_s[3] < with_layer.stage_busy_s[3]
    assert 0 < empty_last.stage_peak_bytes[3] < with_layer.stage_peak_bytes[3]
