"""megatron_ext: searched, layerwise heterogeneous parallel layouts for Megatron-Core.

Layout (imports point one way):
  plan.py, specs.py, presets.py   pure data: plan file, model/cluster specs, presets
  planner/                        cost model and search; never imports torch.distributed or megatron
  runtime/                        device-agnostic torch.distributed code; groups passed explicitly
  megatron_adapter/               the only package that imports megatron.*
  cli.py                          the `megatron-ext` console script; nothing imports it
"""

__version__ = "0.1.0"
