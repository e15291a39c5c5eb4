"""A Checkpoint write that kills its rank halfway: the temporary file half written, the process SIGKILLed, as an out of
memory kill or a preemption during the write would leave it."""
import os
import signal
from pathlib import Path

import ddipp.core.checkpoint
from ddipp.core.files import replacing
from ddipp.core.resume import restart_count

_save_atomic = ddipp.core.checkpoint.save_atomic


def die_writing(epoch: int, step: int, attempt: int) -> None:
    """From now on this process dies while it writes the Checkpoint file of the state after `epoch` epochs and `step`
    batches of the next, in torch elastic's attempt `attempt` (a group's restart count) only."""
    def save(state: dict, path: Path) -> None:
        if restart_count() == attempt and (state["epoch"], state.get("step", 0)) == (epoch, step):
            with replacing(path) as f:
                f.write(b"half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        _save_atomic(state, path)
    ddipp.core.checkpoint.save_atomic = save  # what Checkpoint's write_checkpoint calls
