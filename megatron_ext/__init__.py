"""megatron_ext: searched, layerwise heterogeneous parallel layouts for Megatron-Core.

Layout (imports point one way):
  plan.py, specs.py, presets.py   pure data: plan file, model/cluster specs, presets
  geometry/                       which ranks hold which part of an activation or the vocabulary,
                                  from the plan alone; no torch
  planner/                        cost model and search (vocab/: vocabulary pass placement);
                                  never imports torch or megatron
  runtime/                        device-agnostic torch.distributed code; groups passed explicitly
  megatron_adapter/               the only package that imports megatron.*
  cli.py                          the `megatron-ext` console script; nothing imports it
"""

__version__ = "0.1.0"
