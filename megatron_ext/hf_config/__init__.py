"""HuggingFace `config.json` -> ModelSpec: every field mapped, ignored or refused, never dropped.

A field is
- mapped onto a ModelSpec field with Megatron-LM's meaning (rope_theta -> rotary_base, i.e.
  --rotary-base; a Llama 3 `rope_scaling` -> --use-rope-scaling; qkv biases -> --add-qkv-bias;
  Qwen3's q/k norms -> --qk-layernorm; mixture-of-experts fields -> ModelSpec.moe; ...),
- ignored: it changes nothing for training (token ids, dtype, dropout, generation switches);
  the fields each family may carry are listed, the note says why, and `megatron-ext search
  --model-config` prints them,
- or refused in one line naming the field, its value and what Megatron-LM cannot express
  (multi-latent attention, sliding windows, per-layer attention variants, logit softcapping,
  GeGLU, ...). A field nobody knows is refused too (with the closest known name): a silently
  ignored field is how a different model gets planned.

Both the transformers 4.x and 5.x formats are read (formats.py: `rope_parameters`, `dtype`,
`layer_types`). A field absent from the file takes the default of transformers' config class for
its model_type (defaults.py), and HFModel.defaulted names them; the size fields without such a
default are refused by their HuggingFace name. `model_type` picks the family's implied structure
(Qwen2's q/k/v biases, Qwen3's q/k norms, ...), and families Megatron-LM's GPT layer cannot
express (GPT-J and phi-2 parallel blocks, OLMo 2's norm placement, Gemma) are refused by it.
"""

from megatron_ext.hf_config.fields import MAPPED as _MAPPED
from megatron_ext.hf_config.read import HFModel, model_from_hf_config

__all__ = ["HFModel", "_MAPPED", "model_from_hf_config"]
