"""ddipp.Recompute on fastai v2: bitwise the same fit without it (parameters, BatchNorm buffers, dropout draws) in one
process, on 2 launched ranks under DDP, sync_bn and shard=True, and in notebook mode; undone after every fit; a module
outside the model refused before any step."""
import pytest
import torch
from fastai.callback.core import Callback
from torch import nn

import ddipp
from conftest import ROOT, launch_2_ranks, rank_files
from fit_story import digits_dls
from recompute_story import convnet_learner, recompute_story
from stories import assert_recomputed_bitwise


def test_one_process(tmp_path):
    story = recompute_story(lambda learn: learn, tmp_path, 32)
    assert_recomputed_bitwise(story)
    assert not torch.equal(story[True]["fit"][0], story[True]["unfrozen"][0])  # it trained


@pytest.mark.slow
def test_two_launched_ranks_under_ddp_sync_bn_and_shard(tmp_path):
    launch_2_ranks(ROOT / "tests" / "workers" / "recompute_worker.py", tmp_path)
    for rank in rank_files(tmp_path):
        for options in ("ddp", "sync_bn", "shard"):
            assert_recomputed_bitwise(rank[options])


@pytest.mark.slow
def test_a_notebook_learner_with_the_blocks_it_names(tmp_path):
    story = recompute_story(lambda learn: learn.to_ddp(nprocs=2), tmp_path, 16,
                            modules=lambda learn: [learn.model[0][2]])
    assert_recomputed_bitwise(story)


class Raise(Callback):
    def after_batch(self):
        raise RuntimeError("a step failed")


def test_a_fit_that_raises_leaves_the_models_own_forwards(tmp_path):
    learn = convnet_learner(digits_dls(32), tmp_path)
    with pytest.raises(RuntimeError, match="a step failed"):
        learn.fit(1, cbs=[ddipp.Recompute(), Raise()])
    assert [m for m in learn.model.modules() if "forward" in vars(m)] == []


def test_a_module_outside_the_model_is_refused_before_any_step(tmp_path):
    learn = convnet_learner(digits_dls(32), tmp_path)
    before = [p.clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=r"Recompute\(modules=\.\.\.\) was given a Linear that is not a submodule"):
        learn.fit(1, cbs=ddipp.Recompute([nn.Linear(2, 2)]))
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))
