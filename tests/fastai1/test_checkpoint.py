"""Checkpoint: resuming a 4-epoch one-cycle fit after epoch 2, on 2 ranks (`beyond_ranks`) and in one process."""
import pickle

import pytest
import torch

from beyond import resume_story
from ddipp.core.files import save_atomic
from scenario import TOL, close, max_diff


def test_resumed_fit_ends_with_the_parameters_of_the_uninterrupted_fit_on_2_ranks(beyond_ranks):
    (r0, r1), _ = beyond_ranks
    for rank in (r0, r1):
        res = rank["resume"]
        assert res["saved_epoch"] == 2
        assert max_diff(res["resumed"]["params"], res["full"]["params"]) <= TOL
        assert close(res["resumed"]["val_losses"], res["full"]["val_losses"][2:])
        assert close(res["resumed"]["metrics"], res["full"]["metrics"][2:])


def test_only_rank0_writes_one_file_per_epoch(beyond_ranks):
    (r0, r1), out = beyond_ranks
    assert [p.rsplit("/", 1)[1] for p in r0["replaced"]] == ["full.pth"] * 4 + ["cut.pth"] * 2 + ["cut.pth"] * 2
    assert r1["replaced"] == []
    assert not list((out / "work" / "models").glob(".*.tmp"))


def test_resume_in_one_process(tmp_path):
    res = resume_story(tmp_path)
    assert res["saved_epoch"] == 2
    assert max_diff(res["resumed"]["params"], res["full"]["params"]) <= TOL


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "models" / "ckpt.pth"
    save_atomic({"epoch": 1}, path)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_atomic({"epoch": 2}, path)
    assert torch.load(path) == {"epoch": 1}
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pth"]


class _RunsCode:
    """What an attacker could put in a replaced checkpoint file: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_resuming_reads_the_file_weights_only_so_a_replaced_file_runs_no_code(tmp_path):
    from functools import partial

    import ddipp
    from beyond import ckpt_learner
    learn = ckpt_learner(tmp_path)
    learn.callback_fns.append(partial(ddipp.Checkpoint, name="run"))
    marker = tmp_path / "code-ran"
    (learn.path / learn.model_dir).mkdir()
    torch.save(dict(epoch=2, payload=_RunsCode(marker)), learn.path / learn.model_dir / "run.pth")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        learn.fit_one_cycle(4, 1e-2, start_epoch=2)
    assert not marker.exists()
