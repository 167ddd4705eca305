#!/usr/bin/env python
"""Drop-in for Megatron-LM's pretrain_gpt.py: same flags, plus --strategy-config PLAN.json,
--vocab-parallel, --flexsp and --cpu (gloo). Launch it as Megatron's:

    torchrun --nproc_per_node 8 examples/pretrain_gpt.py <Megatron-LM flags> [--strategy-config
    plan.json]

All logic lives in megatron_ext.megatron_adapter.training (entry.main checks the flags before
torch and megatron-core are imported).
"""

# The guard is required, and the import sits inside it: megatron-core's checkpoint writer starts
# a spawn-context Manager whose child re-imports this file
# (megatron/core/dist_checkpointing/strategies/filesystem_async.py:54); keeping
# the import here makes that child start in milliseconds instead of re-importing megatron-core.
# exit_process leaves without the interpreter's finalization (console.exit_process says why).
if __name__ == "__main__":
    from megatron_ext.megatron_adapter.training.console import exit_process
    from megatron_ext.megatron_adapter.training.entry import main

    exit_process(main())
