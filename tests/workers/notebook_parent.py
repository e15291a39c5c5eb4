"""A stand-in for a notebook kernel, interrupted and then killed mid-fit by tests/interactive/test_group.py.

It prints WORKERS <pids>, then fits until SIGINT (printing INTERRUPTED <weights kept?>), fits once more on a
restarted group (REFIT <epochs recorded> <pids>), then fits again until the test kills it with SIGKILL."""
import signal
import sys

import torch

torch.set_num_threads(1)
# Ctrl-C / the kernel's interrupt raises KeyboardInterrupt, as in a Jupyter kernel, even when this process was
# started with SIGINT ignored (Python then keeps it ignored: a CI job run in the background does that)
signal.signal(signal.SIGINT, signal.default_int_handler)

import ddipp  # noqa: E402
from ddipp.interactive.group import _groups  # noqa: E402
from fastai.basic_train import LearnerCallback  # noqa: E402
from scenario import digits_data, digits_learner, params  # noqa: E402


class Announce(LearnerCallback):
    """Rank 0 says (through the relay of its prints) that training is under way."""

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 2 and ddipp.is_rank0():
            print("TRAINING", flush=True)


def pids():
    return " ".join(str(p.pid) for p in _groups[("cpu", "cpu")].procs)


learn = digits_learner(digits_data(sys.argv[1], bs=16)).to_ddp(nprocs=2)
print("WORKERS", pids(), flush=True)
learn.callback_fns.append(Announce)
before = params(learn)
try:
    learn.fit(1000, 1e-3)
except KeyboardInterrupt:
    print("\nINTERRUPTED", all(torch.equal(a, b) for a, b in zip(before, params(learn))), flush=True)
learn.callback_fns.remove(Announce)
learn.fit(1, 1e-2)
print("\nREFIT", len(learn.recorder.val_losses), pids(), flush=True)
learn.callback_fns.append(Announce)
learn.fit(1000, 1e-3)
