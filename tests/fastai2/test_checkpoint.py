"""Checkpoint (fastai v2): resuming a 4-epoch one-cycle fit after epoch 2, on 2 ranks (`extras_ranks`) and in one
process."""
import pickle
import sys
from pathlib import Path

import pytest
import torch

import ddipp

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from extras import ckpt_learner, launched, resume_story  # noqa: E402
from fit_story import TOL, close, max_diff  # noqa: E402


@pytest.fixture
def extras_ranks(tmp_path_factory):
    """What workers/extras_worker.py saw on each of 2 launched ranks, and its folder (one run per session)."""
    return launched(tmp_path_factory.getbasetemp())


def test_resumed_fit_ends_with_the_parameters_of_the_uninterrupted_fit_on_2_ranks(extras_ranks):
    (r0, r1), _ = extras_ranks
    for rank in (r0, r1):
        res = rank["resume"]
        assert res["saved_epoch"] == 2
        assert max_diff(res["resumed"]["params"], res["full"]["params"]) <= TOL
        assert res["resumed"]["values"][:2] == [[], []]  # skipped
        assert close(res["resumed"]["values"][2:], res["full"]["values"][2:])


def test_only_rank0_writes_one_file_per_epoch(extras_ranks):
    (r0, r1), out = extras_ranks
    assert [p.rsplit("/", 1)[1] for p in r0["replaced"]] == ["full.pth"] * 4 + ["cut.pth"] * 2 + ["cut.pth"] * 2
    assert r1["replaced"] == []
    assert not list((out / "work" / "models").glob(".*.tmp"))


def test_resume_in_one_process(tmp_path):
    res = resume_story(tmp_path)
    assert res["saved_epoch"] == 2
    assert max_diff(res["resumed"]["params"], res["full"]["params"]) == 0
    assert res["resumed"]["values"][2:] == res["full"]["values"][2:]


def test_a_start_epoch_without_its_checkpoint_is_refused_with_the_epoch_to_pass(tmp_path):
    learn = ckpt_learner(tmp_path)
    with pytest.raises(FileNotFoundError, match="start_epoch=1: no checkpoint at .*run.pth; fit from the start"):
        learn.fit(2, 1e-2, start_epoch=1, cbs=ddipp.Checkpoint(name="run"))
    learn.fit(1, 1e-2, cbs=ddipp.Checkpoint(name="run"))
    with pytest.raises(ValueError, match="start_epoch=2, but .*run.pth holds the state after 1 epochs; "
                                         "pass start_epoch=1"):
        ckpt_learner(tmp_path).fit(3, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name="run"))


def test_validate_get_preds_and_lr_find_write_no_checkpoint(tmp_path):
    learn = ckpt_learner(tmp_path).add_cb(ddipp.Checkpoint(name="run"))
    learn.validate()
    learn.get_preds()
    learn.lr_find(num_it=5, show_plot=False)
    assert not (tmp_path / "models" / "run.pth").exists()


class _RunsCode:
    """What an attacker could put in a replaced checkpoint file: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_resuming_reads_the_file_weights_only_so_a_replaced_file_runs_no_code(tmp_path):
    learn = ckpt_learner(tmp_path)
    marker = tmp_path / "code-ran"
    (tmp_path / "models").mkdir()
    torch.save(dict(epoch=2, payload=_RunsCode(marker)), tmp_path / "models" / "run.pth")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        learn.fit_one_cycle(4, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name="run"))
    assert not marker.exists()
