"""Cost model of the strategy search: compute, communication, memory and the 1F1B pipeline.

`CostModel` (model.py) is the public entry point; the other modules hold its small formulas.
"""
