"""A stand-in for a notebook kernel running fastai v2, interrupted and then killed mid-fit by
tests/fastai2/notebook/test_fitting.py.

It prints WORKERS <pids>, then fits until SIGINT: the ranks stop after the same step and it prints INTERRUPTED
<weights trained?> <epochs recorded> <steps recorded>; it fits once more (REFIT <epochs recorded> <pids>), then fits
until the test kills it."""
import signal
import sys
import tempfile

import torch

torch.set_num_threads(1)
# Ctrl-C / the kernel's interrupt raises KeyboardInterrupt, as in a Jupyter kernel, even when this process was
# started with SIGINT ignored (Python then keeps it ignored: a CI job run in the background does that)
signal.signal(signal.SIGINT, signal.default_int_handler)

from fastai.callback.core import Callback  # noqa: E402
from fit_story import digits_dls, digits_learner, params  # noqa: E402
from stories import pids  # noqa: E402

import ddipp  # noqa: E402


class Announce(Callback):
    """Rank 0 says (through the relay of its prints) that training is under way."""

    def after_batch(self):
        if self.training and self.iter == 2 and ddipp.is_rank0():
            print("TRAINING", flush=True)


learn = digits_learner(digits_dls(bs=16), sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()).to_ddp(nprocs=2)
print("WORKERS", pids(), flush=True)
before = params(learn)
try:
    learn.fit(1000, 1e-3, cbs=Announce())
except KeyboardInterrupt:
    trained = any(not torch.equal(a, b) for a, b in zip(before, params(learn)))
    print("\nINTERRUPTED", trained, len(learn.recorder.values), len(learn.recorder.losses), flush=True)
learn.fit(1, 1e-2)
print("\nREFIT", len(learn.recorder.values), pids(), flush=True)
learn.fit(1000, 1e-3, cbs=Announce())
