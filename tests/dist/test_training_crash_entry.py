"""torchrun entry used by test_training.py: examples/pretrain_gpt.py, SIGKILLed in the middle of
the save at iteration $MEGATRON_EXT_TEST_CRASH_AT_SAVE.

Every rank kills itself right after megatron-core's `dist_checkpointing.save` has written its
shards and before megatron_ext publishes the directory and the tracker file: the worst moment
for a crash. No test lives here; pytest collects nothing from this file.
"""

import os
import signal
import sys


def _install_crash(crash_at: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real_save = dist_checkpointing.save

    def save_then_die(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if sharded_state_dict.get("iteration") == crash_at:
            # megatron-core's writer queue lives in a Manager process that a SIGKILL would
            # orphan; stop it first so the test leaves no process behind.
            queue = filesystem_async._results_queue
            if queue is not None:
                queue._manager.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die


if __name__ == "__main__":
    _install_crash(int(os.environ["MEGATRON_EXT_TEST_CRASH_AT_SAVE"]))
    from megatron_ext.megatron_adapter.training.entry import main

    sys.exit(main())
