"""Where the vocabulary passes run inside 1F1B (vocab.mode vocab_parallel; no torch).

Modules: schedule_ops (the pass vocabulary and Megatron's 1F1B skeleton), schedule_sim
(discrete-event replay of pass orders; proves an order deadlock-free), schedule_plan
(`plan_vocab_schedule`: places the passes), pass_costs (analytic per-pass costs for placement
and coarse predictions). The search's cost of a vocabulary strategy is planner/cost/vocab.py;
the runtime that executes the placed orders is runtime/vocab/ with megatron_adapter/vocab/.
"""
