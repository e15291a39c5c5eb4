"""Checkpoint: resuming a 4-epoch one-cycle fit after epoch 2, on 2 ranks (`beyond_ranks`) and in one process;
resuming a 3-epoch fit after epoch 2 on the data fastai users build."""
import re
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from fastai.basic_train import Learner
from fastai.tabular import Categorify, Normalize, TabularDataBunch, tabular_learner
from fastai.vision import ImageDataBunch, ImageList

import ddipp
from beyond import DieWriting, KillRank1, StopAt, ckpt_learner, resume_story
from conftest import check_restart_said, image_folder, launch_restartable, rank_files, tiny_cnn
from ddipp.core.checkpoint import DamagedCheckpoint
from ddipp.core.files import save_atomic
from ddipp.core.group.group import shutdown
from ddipp.core.rng import seed_all
from compare import TOL, close, max_diff
from scenario import digits_data, digits_learner, history, params
from stories import RunsCode


@pytest.mark.slow
def test_resumed_fit_ends_with_the_parameters_of_the_uninterrupted_fit_on_2_ranks(beyond_ranks):
    (r0, r1), _ = beyond_ranks
    for rank in (r0, r1):
        res = rank["resume"]
        assert res["saved_epoch"] == 2
        assert max_diff(res["resumed"]["params"], res["full"]["params"]) <= TOL
        assert close(res["resumed"]["val_losses"], res["full"]["val_losses"])  # epochs 0 and 1 from the file
        assert close(res["resumed"]["metrics"], res["full"]["metrics"])


@pytest.mark.slow
def test_only_rank0_writes_one_file_per_epoch(beyond_ranks):
    (r0, r1), out = beyond_ranks
    assert [p.rsplit("/", 1)[1] for p in r0["replaced"]] == ["full.pth"] * 4 + ["cut.pth"] * 2 + ["cut.pth"] * 2
    assert r1["replaced"] == []
    assert not list((out / "work" / "models").glob(".*.tmp"))


def test_keep_leaves_the_checkpoints_before_the_last(tmp_path):
    learn = ckpt_learner(tmp_path)
    learn.fit(3, 1e-2, callbacks=[ddipp.Checkpoint(learn, name="kept", keep=2)])
    saved = {p.name: torch.load(p, weights_only=True)["epoch"] for p in (tmp_path / "models").glob("kept*.pth")}
    assert saved == {"kept.pth": 3, "kept.1.pth": 2}


def test_a_plain_fit_refuses_a_file_written_mid_epoch_naming_what_resumes_it(tmp_path):
    learn = ckpt_learner(tmp_path)
    (tmp_path / "models").mkdir(exist_ok=True)
    save_atomic(dict(model={}, opt={}, epoch=1, step=3), tmp_path / "models" / "cut.pth")
    with pytest.raises(ValueError, match=r"cut\.pth holds the state after epoch 1 and 3 batches of epoch 2: a learner "
                                         r"made with to_ddp\(\) resumes it in the middle of an epoch"):
        learn.fit_one_cycle(3, 1e-2, start_epoch=1, callbacks=[ddipp.Checkpoint(learn, name="cut")])


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


def test_resuming_reads_the_file_weights_only_so_a_replaced_file_runs_no_code(tmp_path):
    from functools import partial

    import ddipp
    from beyond import ckpt_learner
    learn = ckpt_learner(tmp_path)
    learn.callback_fns.append(partial(ddipp.Checkpoint, name="run"))
    marker = tmp_path / "code-ran"
    (learn.path / learn.model_dir).mkdir()
    torch.save(dict(epoch=2, payload=RunsCode(marker)), learn.path / learn.model_dir / "run.pth")
    with pytest.raises(DamagedCheckpoint, match=r"run\.pth is not a checkpoint ddipp wrote: it holds \S*open, "
                                                r"which a weights-only load refuses") as refused:
        learn.fit_one_cycle(4, 1e-2, start_epoch=2)
    assert not marker.exists()
    assert "weights_only" not in str(refused.value)  # torch's advice to load it unsafely


def image_learner(path: Path) -> Learner:
    return Learner(ImageDataBunch.from_folder(image_folder(path), bs=8, num_workers=0), tiny_cnn())


def data_block_learner(path: Path) -> Learner:
    data = (ImageList.from_folder(image_folder(path)).split_by_folder().label_from_folder()
            .databunch(bs=8, num_workers=0))
    return Learner(data, tiny_cnn())


def tabular_ckpt_learner(path: Path) -> Learner:
    rng = np.random.default_rng(0)
    df = pd.DataFrame(dict(colour=rng.choice(["red", "green", "blue"], 64), size=rng.normal(size=64)))
    df["big"] = (df["size"] > 0).astype(int)
    data = TabularDataBunch.from_df(path, df, "big", valid_idx=list(range(48, 64)), procs=[Categorify, Normalize],
                                    cat_names=["colour"], cont_names=["size"], bs=8, num_workers=0)
    return tabular_learner(data, layers=[8], ps=[0.2])


@pytest.mark.parametrize("make", [image_learner, data_block_learner, tabular_ckpt_learner])
def test_a_fit_stopped_after_epoch_2_resumes_in_a_plain_process_to_the_weights_of_the_whole_fit(tmp_path, make):
    def fresh(seed: int, *callback_fns) -> Learner:
        seed_all(seed)  # the weights, the loaders' order (torch's generator), the dropout
        learn = make(tmp_path)
        learn.callback_fns += list(callback_fns)
        return learn
    whole = fresh(0, partial(ddipp.Checkpoint, name="whole"))
    whole.fit_one_cycle(3, 1e-2)
    with pytest.raises(KeyboardInterrupt):
        fresh(0, partial(ddipp.Checkpoint, name="cut"), partial(StopAt, at=2)).fit_one_cycle(3, 1e-2)
    resumed = fresh(1, partial(ddipp.Checkpoint, name="cut"))  # other weights, draws and order than the stopped fit
    resumed.fit_one_cycle(3, 1e-2, start_epoch=2)
    assert max_diff(params(resumed), params(whole)) == 0


@pytest.mark.slow
def test_elastic_restarts_resume_the_cut_fits_by_themselves_as_if_they_never_stopped(tmp_path):
    worker = Path(__file__).parent / "workers" / "restart_worker.py"
    said = launch_restartable(worker, tmp_path / "killed", "kill")
    launch_restartable(worker, tmp_path / "whole", "whole")
    for killed, whole in zip(rank_files(tmp_path / "killed"), rank_files(tmp_path / "whole")):
        assert (killed["restarts"], whole["restarts"]) == (5, 0)
        assert max_diff(killed["params"], whole["params"]) <= 1e-6
        assert [len(killed["histories"][f]["val_losses"]) for f in (3, 4)] == [1, 3]  # each epoch once
        assert len(killed["histories"][4]["losses"]) == 3 * 44  # each batch once
        for f in (3, 4):  # fit 3: its end state loaded (the last restart skipped fits 1 and 2)
            assert close(killed["histories"][f], whole["histories"][f], tol=1e-6)
    models = tmp_path / "killed" / "work" / "models"
    assert f"ddipp: restart 1: fit 1 starts from scratch (no checkpoint of this launch in {models}" in said
    assert "ddipp: restart 2: fit 1 finished before the restart: skipped" in said
    assert f"ddipp: restart 2: fit 2 resumed after epoch 2 from {models}" in said
    assert f"ddipp: restart 3: fit 2 had ended before the restart: the state it ended with loaded from {models}" \
        in said
    assert f"ddipp: restart 4: fit 4 resumed after epoch 0 and 12 batches of epoch 1 from {models}" in said
    # its newest file truncated: from the one its Checkpoint (keep=2) kept before it
    folder = re.escape(str(models))
    assert re.search(rf"ddipp: restart 5: fit 4 resumed after epoch 1 and 4 batches of epoch 2 from "
                     rf"{folder}/steps\.1\.pth \({folder}/steps\.pth is truncated: a zip archive of \d+ bytes "
                     r"without its end\)\n", said)


@pytest.mark.slow
def test_a_notebook_fit_whose_worker_died_resumes_on_a_new_group_when_restarts_are_asked(tmp_path, capsys):
    shutdown()  # a new group: its first attempt, its fits numbered from 1 (an earlier test may have left one)
    def fit(name: str, *cbs) -> Learner:
        learn = digits_learner(digits_data(tmp_path, bs=16, shuffle=True)).to_ddp(nprocs=2, restarts=2)
        seed_all(0)
        learn.fit_one_cycle(3, 1e-2, callbacks=[ddipp.Checkpoint(learn, name, every_steps=6),
                                                *[cb(learn) for cb in cbs]])
        return learn
    whole = fit("whole")
    # rank 1 dies before the first checkpoint (the fit runs again from the start), then rank 0 while it writes the
    # checkpoint of batch 15 of epoch 1 (the fit resumes from the one of batch 9)
    killed = fit("cut", partial(KillRank1, epoch=0, batch=3), partial(DieWriting, epoch=1, step=16, attempt=1))
    said = capsys.readouterr()
    assert max_diff(params(killed), params(whole)) <= 1e-6
    assert close(history(killed), history(whole), tol=1e-6)
    check_restart_said(said, tmp_path / "models")
    killed.fit(1, 1e-3, callbacks=[ddipp.Checkpoint(killed, "later")])  # the restarted group's next fit: no restart
    assert "ddipp: restart" not in capsys.readouterr().out
