"""A callback that kills rank 1 once its fit ended, for the notebook's restart tests (pickled to the workers by
reference: this module is on their path)."""
import os
import signal
from pathlib import Path

import torch.distributed as dist
from fastai.callback.core import Callback

import ddipp


class DieAfterFit(Callback):
    """Kills rank 1 (SIGKILL) after its fit, once rank 0 wrote the fit's last checkpoint, the first time only (it
    leaves the file `marker`): the group that replaces it does not die again."""

    def __init__(self, marker: Path):
        self.marker = marker

    def after_fit(self):
        dist.barrier()  # rank 0 wrote the checkpoint of the last epoch before it came here
        if ddipp.rank() == 1 and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
