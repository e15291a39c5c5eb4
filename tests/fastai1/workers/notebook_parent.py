"""A stand-in for a notebook kernel, interrupted twice and then killed mid-fit by tests/interactive/test_group.py.

It prints WORKERS <pids>, then fits until SIGINT: the ranks stop after the same step and it prints INTERRUPTED
<weights trained?> <epochs recorded> <steps recorded>. It fits once more (REFIT <epochs recorded> <pids>), then fits
with rank 1 stuck outside torch until SIGINT: the ranks cannot stop, the group is killed and it prints STUCK
<weights as before?>. Then it fits again until the test kills it with SIGKILL."""
import signal
import sys
import threading

import torch

torch.set_num_threads(1)
# Ctrl-C / the kernel's interrupt raises KeyboardInterrupt, as in a Jupyter kernel, even when this process was
# started with SIGINT ignored (Python then keeps it ignored: a CI job run in the background does that)
signal.signal(signal.SIGINT, signal.default_int_handler)

import ddipp  # noqa: E402
from fastai.basic_train import LearnerCallback  # noqa: E402
from scenario import digits_data, digits_learner, params  # noqa: E402
from stories import pids  # noqa: E402


class Announce(LearnerCallback):
    """Rank 0 says (through the relay of its prints) that training is under way."""

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 2 and ddipp.is_rank0():
            print("TRAINING", flush=True)


class StuckRank1(Announce):
    def on_batch_end(self, iteration, **kwargs):
        super().on_batch_end(iteration)
        if iteration == 2 and ddipp.rank() == 1:
            threading.Event().wait()


def same(before, learn):
    return all(torch.equal(a, b) for a, b in zip(before, params(learn)))


learn = digits_learner(digits_data(sys.argv[1], bs=16)).to_ddp(nprocs=2)
print("WORKERS", pids(), flush=True)
learn.callback_fns.append(Announce)
before = params(learn)
try:
    learn.fit(1000, 1e-3)
except KeyboardInterrupt:
    print("\nINTERRUPTED", not same(before, learn), len(learn.recorder.val_losses), len(learn.recorder.losses),
          flush=True)
learn.callback_fns.remove(Announce)
learn.fit(1, 1e-2)
print("\nREFIT", len(learn.recorder.val_losses), pids(), flush=True)
learn.callback_fns.append(StuckRank1)
before = params(learn)
try:
    learn.fit(1000, 1e-3)
except KeyboardInterrupt:
    print("\nSTUCK", same(before, learn), flush=True)
learn.callback_fns[-1] = Announce
learn.fit(1000, 1e-3)
