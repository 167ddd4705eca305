"""megatron_ext: searched, layerwise heterogeneous parallel layouts for Megatron-Core.

Layout (imports point one way):
  plan.py, specs.py, presets.py   pure data: plan file, model/cluster specs, presets
  geometry/                       which ranks hold which part of an activation or the vocabulary,
                                  from the plan alone; no torch
  flags/                          Megatron-LM's flags as data: catalog, parser, plan <-> flags
  planner/                        cost model and search (vocab/: vocabulary pass placement);
                                  never imports torch or megatron
  calibration/                    the cost model scored and fitted on published measured runs
  runtime/                        device-agnostic torch.distributed code; groups passed explicitly
  megatron_adapter/               the only package that imports megatron.*
  commands/, cli.py               the `megatron-ext` subcommands and console script; nothing
                                  imports them
"""

__version__ = "0.1.0"
