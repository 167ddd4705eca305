"""The package's table of HuggingFace config-class defaults (megatron_ext/hf_config/defaults.py,
read at run time without transformers) equals transformers' own classes (the dev extra's
transformers 5), and covers every field of a class that the reader maps."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import CONFIG_MAPPING

from megatron_ext.hf_config.defaults import DEFAULTS
from megatron_ext.hf_config.fields import MAPPED

# 5.x-only spellings, read by formats.py: rope_theta stands for rope_parameters, and
# layer_types is derived from the sliding-window fields
NOT_TABLED = {"rope_parameters", "layer_types"}
TRANSFORMERS_FAMILIES = sorted(set(DEFAULTS) - {"deepseek"})  # DeepSeek-MoE is remote code


def _class_defaults(family: str) -> tuple[str, dict]:
    cls = CONFIG_MAPPING[family]
    fields = {f.name: f.default for f in dataclasses.fields(cls)
              if f.default is not dataclasses.MISSING}
    return cls.__name__, {**fields, "rope_theta": cls.default_theta}


@pytest.mark.parametrize("family", TRANSFORMERS_FAMILIES)
def test_defaults_are_transformers_defaults(family: str) -> None:
    name, ours = DEFAULTS[family]
    cls_name, theirs = _class_defaults(family)
    assert name == cls_name
    assert ours == {k: theirs[k] for k in ours if k in theirs}, family
    assert set(ours) <= set(theirs)


@pytest.mark.parametrize("family", TRANSFORMERS_FAMILIES)
def test_defaults_cover_every_mapped_field(family: str) -> None:
    _, theirs = _class_defaults(family)
    mapped = {k for k in theirs if k in MAPPED} - NOT_TABLED
    if family == "gpt2":
        mapped.discard("rope_theta")  # learned positions; default_theta is the base class's
    assert mapped <= set(DEFAULTS[family][1]), sorted(mapped - set(DEFAULTS[family][1]))
