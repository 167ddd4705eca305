#!/usr/bin/env python
"""JSONL -> megatron-core indexed dataset (.bin/.idx); Megatron-LM's tools/preprocess_data.py flags.

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 4
"""

import sys

from megatron_ext.megatron_adapter.training.preprocess import main
from megatron_ext.warning_filters import install as install_warning_filters

if __name__ == "__main__":  # spawn-safe: worker processes re-import this file
    install_warning_filters()
    sys.exit(main())
