"""ddipp.core.parallel: DDP's wrapper of a fit's model passes on what callbacks ask of the model; another Strategy put
in DDP's place (tests/core/workers/stub_strategy.py's HandAveraged) trains as DDP does, on 2 ranks (`core_ranks`)."""
from contextlib import ExitStack

import pytest
import torch.distributed as dist
from torch import nn

from compare import TOL
from ddipp.core import parallel
from ddipp.core.options import Options
from test_state import state_diff


@pytest.mark.slow
def test_a_strategy_put_in_ddps_place_is_the_one_a_fit_uses_and_trains_as_ddp(core_ranks):
    """parallel.strategy swapped for a lambda making HandAveraged: the loop of an adapter's DistributedCallback
    (strategy(options), wrap, steps, full_state through it) trains the same model and Adam state as DDP on both ranks,
    and the hooks it added are gone once the fit's undo ran."""
    (r0, r1), _ = core_ranks
    for rank in (r0, r1):
        stub, ddp = rank["stub_fit"], rank["ddp_fit"]
        assert (stub["strategy"], ddp["strategy"]) == ("HandAveraged", "DDP")
        assert state_diff(stub["state"], r0["ddp_fit"]["state"]) <= TOL
        assert stub["hooked"] == (True, False) and ddp["hooked"] == (False, False)


class Head(nn.Module):
    """A custom head: a submodule, a plain attribute, a method, and an attribute named as one of DDP's own."""

    def __init__(self):
        super().__init__()
        self.tst, self.scale, self.logger, self.resets = nn.Linear(2, 2), 2.0, "the head's", 0

    def forward(self, x):
        return self.tst(x) * self.scale

    def reset(self):
        self.resets += 1


def test_what_the_ddp_wrapper_lacks_reads_and_writes_through_to_the_model(tmp_path):
    """fastai's callbacks read `learn.model.tst` (its 13a tests), custom heads' and timm models' attributes, and
    RNNs' `reset()`; under DDP each failed with "'DistributedDataParallel' object has no attribute ..."."""
    model = Head()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with ExitStack() as undo:
            wrapped = parallel.DDP(Options()).wrap(model, None, undo)
            assert wrapped.tst is model.tst and wrapped.scale == 2.0
            wrapped.reset()
            wrapped.scale = 3.0  # the model's attribute: written to the model
            wrapped.note = "new"  # one neither has: on the wrapper, as DDP keeps it
            assert model.resets == 1 and model.scale == 3.0 and not hasattr(model, "note")
            assert model.logger == "the head's" and wrapped.logger is not model.logger  # DDP's own stay its own
            assert wrapped.training and wrapped.module is model
            with pytest.raises(AttributeError, match="'Head' object has no attribute 'missing'"):
                wrapped.missing
    finally:
        dist.destroy_process_group()


def test_indexing_the_wrapped_model_indexes_the_model(tmp_path):
    """fastai's callbacks and hooks index the model (`learn.model[0]`, a cnn_learner's body); DDP is not indexable."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with ExitStack() as undo:
            wrapped = parallel.DDP(Options()).wrap(model, None, undo)
            assert wrapped[0] is model[0] and list(wrapped[1:]) == list(model[1:]) and bool(wrapped)
        with ExitStack() as undo:
            with pytest.raises(TypeError, match="'Linear' object is not subscriptable"):
                parallel.DDP(Options()).wrap(nn.Linear(2, 1), None, undo)[0]
    finally:
        dist.destroy_process_group()
