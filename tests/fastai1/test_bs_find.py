"""learn.bs_find() on fastai v1: the largest batch size whose training step fits under each rank's ceiling (a forward
pre-hook raising torch.OutOfMemoryError above it: bs_find_story.py), the same on every rank; the learner left as it was
(a fit after it equals a fit without it, bit for bit); in one process, on 2 launched ranks (to_ddp(), split_batches,
shard=True) and in notebook mode; bad input and a start that does not fit refused by name."""
import re
from functools import partial
from typing import Optional

import pytest
import torch
from fastai.basic_train import LearnerCallback
from fastai.callbacks import CSVLogger, RNNTrainer

import ddipp
from bs_find_story import CEILINGS, bs_find_story, ceiling_learner, held, learner_facts, same_facts, tensors
from compare import assert_same_tensors
from conftest import ROOT, launch_2_ranks, rank_files
from stories import RNNLike

FITS_EVERYWHERE = min(CEILINGS.values())
PER_PROCESS = (f"bs_find: bs={FITS_EVERYWHERE} per process: global batch {2 * FITS_EVERYWHERE} = {FITS_EVERYWHERE} x 2 "
               "processes")


def check_story(story: dict, found: int, said: Optional[str]) -> None:
    """bs_find found `found` and said so below its table, with `said` (None: no table, as on rank > 0); the learner
    stayed as it was."""
    assert story["found"] == found
    if said is None:
        assert "batch size" not in story["said"]
    else:
        assert "batch size  verdict" in story["said"] and said in story["said"]
        assert re.search(rf"^bs_find: the largest batch size that fits.*: {found}$", story["said"], re.M)
    assert story["kept"]  # the learner's attributes (recorder, optimizer, loaders...) the same objects
    assert_same_tensors(story["before"], story["after"])  # weights, BatchNorm buffers, optimizer, generator
    assert_same_tensors(story["fit"], story["plain_fit"])  # a fit after bs_find is the fit without it
    assert not story["fresh_has_opt"]  # a new learner has no optimizer nor recorder after it, as before


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return bs_find_story(lambda learn: learn, tmp_path_factory.mktemp("one"))


def test_one_process(one_process):
    check_story(one_process, CEILINGS[0], "")
    assert "per process" not in one_process["said"] and "global batch" not in one_process["said"]


class SeenByTheFit(LearnerCallback):
    """What the fit's other callbacks see: the batches it ran and the learner at its end (in `SEEN`, as bs_find puts
    the learner's attributes back)."""
    _order = -26  # before bs_find's callback: it runs in bs_find's fit

    def on_train_begin(self, **kwargs):
        self.batches = 0

    def on_batch_begin(self, **kwargs):
        self.batches += 1

    def on_train_end(self, **kwargs):
        SEEN.append((self.batches, held(self.learn)))


SEEN = []


def test_the_fit_runs_no_batch_and_leaves_no_trace(tmp_path):
    learn = ceiling_learner(tmp_path)
    learn.callback_fns.append(partial(CSVLogger, filename="history"))
    learn.fit(1, 1e-2)
    before, history = held(learn), (tmp_path / "history.csv").read_text()
    learn.callback_fns.append(SeenByTheFit)
    learn.bs_find()
    batches, seen = SEEN.pop()
    assert batches == 0
    assert_same_tensors(before, seen)  # its callbacks see the weights, buffers and optimizer state as they were
    assert (tmp_path / "history.csv").read_text() == history  # CSVLogger left out of the fit: its file as it was


def test_bad_input_is_refused_before_any_work(tmp_path):
    learn = ceiling_learner(tmp_path)
    with pytest.raises(ValueError, match=r"max_bs=8 is below start=16; give max_bs=16 or more"):
        learn.bs_find(start=16, max_bs=8)
    with pytest.raises(ValueError, match=r"the training set holds 1438 items, fewer than start=2000"):
        learn.bs_find(start=2000)
    with pytest.raises(ValueError, match=r"start=1 gives a process 1 item a step, and the model's BatchNorm cannot"):
        learn.bs_find(start=1)
    assert "opt" not in vars(learn) and "recorder" not in vars(learn)  # no fit ran


def test_a_start_that_does_not_fit_is_named_and_leaves_the_learner(tmp_path):
    learn = ceiling_learner(tmp_path)
    learn.fit(1, 1e-2)
    before, facts = tensors(learn), learner_facts(learn)
    with pytest.raises(torch.OutOfMemoryError, match=r"batch size 400 \(start\) ran out of memory.*split_batches=True"):
        learn.bs_find(start=400)
    assert same_facts(facts, learner_facts(learn))
    assert_same_tensors(before, tensors(learn))


def test_trials_run_under_recompute_and_a_refused_start_leaves_no_block_recomputing(tmp_path):
    learn = ceiling_learner(tmp_path)
    learn.callback_fns.append(ddipp.Recompute)  # _order -30: its blocks recompute before bs_find's trials
    recomputing = []
    learn.model.register_forward_pre_hook(
        lambda model, args: recomputing.append(any("forward" in vars(m) for m in model.modules())))
    assert learn.bs_find(max_bs=8) == 8
    assert recomputing and all(recomputing)
    with pytest.raises(torch.OutOfMemoryError):
        learn.bs_find(start=400)  # raised after the fit: Recompute's on_train_end ran
    assert [m for m in learn.model.modules() if "forward" in vars(m)] == []


def test_a_recurrent_models_output(tmp_path):
    learn = ceiling_learner(tmp_path)
    learn.model = RNNLike(learn.model)
    learn.callbacks.append(RNNTrainer(learn))  # as RNNLearner: its on_loss_begin gives the loss the first output
    assert learn.bs_find(max_bs=64) == 64


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("launched")
    launch_2_ranks(ROOT / "tests" / "fastai1" / "workers" / "bs_find_worker.py", out)
    return rank_files(out)


@pytest.mark.slow
def test_two_launched_ranks_find_the_size_that_fits_on_both(launched):
    for rank, res in enumerate(launched):  # the table on rank 0 alone
        check_story(res["ddp"], FITS_EVERYWHERE, None if rank else PER_PROCESS)
        # split_batches: each rank tries rank 0's part of the global batch (the larger), so the global batch found
        # is twice the smallest ceiling
        check_story(res["split"], 2 * FITS_EVERYWHERE, None if rank else (
            f"bs_find: global batch {2 * FITS_EVERYWHERE} ({FITS_EVERYWHERE} + {FITS_EVERYWHERE} over 2 processes, "
            "split_batches)"))
        check_story(res["shard"], FITS_EVERYWHERE, None if rank else (
            "bs_find: shard=True: the trials ran the whole model on each process"))


@pytest.mark.slow
def test_launched_refusals_name_the_start_and_keep_the_group(launched):
    for res in launched:
        assert res["split_start_refused"] == ("bs_find: start=2 gives a process 1 item a step, and the model's "
                                              "BatchNorm cannot train on fewer than 2: give start=4 or more")
        assert "batch size 250 (start) ran out of memory on at least one rank" in res["start_refused"]
    assert_same_tensors(*(res["fit_after_refusal"] for res in launched))  # both ranks trained together after it


@pytest.mark.slow
def test_a_notebook_learner(tmp_path):
    story = bs_find_story(lambda learn: learn.to_ddp(nprocs=2), tmp_path)
    check_story(story, FITS_EVERYWHERE, PER_PROCESS)
