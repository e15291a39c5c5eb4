"""A second Strategy, not DDP (tests/core/workers/stub_strategy.py's HandAveraged), put in ddipp.core.parallel's place
for a fit with a Checkpoint, lr_find and a fit resumed from the file: each fastai adapter runs them through it
unchanged, its calls counted."""
from collections import Counter
from typing import Callable

from ddipp.core import parallel
from stub_strategy import HandAveraged


class Counted(HandAveraged):
    """HandAveraged that counts the calls an adapter makes of it (class-wide: an adapter builds one per callback)."""
    calls = Counter()

    def wrap(self, model, optimizer, undo):
        self.calls["wrap"] += 1
        return super().wrap(model, optimizer, undo)

    def full_state(self, model, optimizer):
        self.calls["full_state"] += 1
        return super().full_state(model, optimizer)

    def load_full_state(self, model, optimizer, state):
        self.calls["load_full_state"] += 1
        return super().load_full_state(model, optimizer, state)


def second_strategy(make_learner: Callable, fit: Callable, sweep: Callable, resume: Callable) -> dict:
    """With Counted as the strategy: a learner from `make_learner()`, `fit(learn)` (one epoch, writing a Checkpoint),
    `sweep(learn)` (lr_find), `resume(learn)` (a fit from the Checkpoint's file); the parameters after `fit` and the
    calls made of the strategy."""
    strategy = parallel.strategy
    Counted.calls.clear()
    parallel.strategy = Counted
    try:
        learn = make_learner()
        fit(learn)
        fitted = [p.detach().clone() for p in learn.model.parameters()]
        sweep(learn)
        resume(learn)
    finally:
        parallel.strategy = strategy
    return dict(params=fitted, calls=dict(Counted.calls))
