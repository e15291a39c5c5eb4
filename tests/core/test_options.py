"""ddipp.core.options.Options: to_ddp's options checked once when made, frozen, and sent to a notebook's workers as
they are."""
import dataclasses
import pickle

import pytest

from ddipp.core.group.wire import dumps, loads
from ddipp.core.options import Options


@pytest.mark.parametrize("given, message", [
    (dict(lr_find_mode="fast"), "to_ddp(lr_find_mode='fast'): use 'solo' (rank 0 sweeps alone) or 'distributed'"),
    (dict(timeout=0), "to_ddp(timeout=0): timeout is the seconds a rank may wait for the others, a number > 0"),
    (dict(timeout=True), "to_ddp(timeout=True): timeout is the seconds"),
    (dict(timeout="600"), "to_ddp(timeout='600'): timeout is the seconds"),
    (dict(split_batches="yes"), "to_ddp(split_batches='yes'): True (the loader's batch is the global batch, split"),
    (dict(restarts=-1), "to_ddp(restarts=-1): restarts is how many times a notebook fit whose worker died starts a "
                        "new group and resumes from its Checkpoint, a whole number >= 0"),
    (dict(restarts=1.5), "to_ddp(restarts=1.5): restarts is how many times"),
    (dict(restarts=True), "to_ddp(restarts=True): restarts is how many times"),
    (dict(sync_bn="yes"), "to_ddp(sync_bn='yes'): True (BatchNorm layers sync their statistics"),
    (dict(find_unused_parameters=1), "to_ddp(find_unused_parameters=1): True, False, or None")])
def test_a_bad_value_is_refused_naming_it_and_what_to_give(given, message):
    with pytest.raises(ValueError) as raised:
        Options(**given)
    assert str(raised.value).startswith(message), raised.value


def test_options_are_frozen():
    options = Options(split_batches=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout = -1
    assert options.timeout == 600 and options.split_batches


def test_options_pickle_as_the_workers_receive_them_and_come_back_equal():
    options = Options(sync_bn=True, find_unused_parameters=False, lr_find_mode="distributed", split_batches=True,
                      timeout=30.5, restarts=2)
    for back in (pickle.loads(pickle.dumps(options)), loads(dumps(options))):  # wire: what a fit's message carries
        assert back == options and back is not options and type(back) is Options
    assert Options() != options
