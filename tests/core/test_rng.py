"""ddipp.core.rng: generator states that survive a weights-only save and load, and bring back the same draws."""
import random

import numpy as np
import pytest
import torch

from ddipp.core.files import save_atomic
from ddipp.core.rng import every_rank, rng_state, set_rng_state, this_rank


def draws() -> list:
    return [random.random(), random.gauss(0, 1), float(np.random.rand()), float(torch.rand(()))]


def test_a_state_saved_and_loaded_weights_only_brings_back_the_same_draws(tmp_path):
    random.gauss(0, 1)  # python and numpy cache a gaussian draw in their state: it must come back too
    np.random.standard_normal()
    save_atomic(dict(rngs=every_rank(rng_state())), tmp_path / "rngs.pth")
    expected = draws()
    draws()
    (state,) = torch.load(tmp_path / "rngs.pth", weights_only=True)["rngs"]
    set_rng_state(state)
    assert draws() == expected


def test_states_of_another_group_size_are_not_restored_and_the_warning_says_which_file():
    with pytest.warns(UserWarning, match="ckpt.pth was written by 2 ranks, this group has 1: random number"):
        assert this_rank(["rank 0's", "rank 1's"], "ckpt.pth") is None
    assert this_rank(["mine"], "ckpt.pth") == "mine"
