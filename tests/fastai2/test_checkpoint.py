"""Checkpoint (fastai v2): resuming a 4-epoch one-cycle fit after epoch 2, on 2 ranks (`extras_ranks`) and in one
process; resuming a 3-epoch fit after epoch 2 on the loaders fastai users build."""
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from fastai.callback.core import Callback
from fastai.callback.training import GradientAccumulation
from fastai.data.block import CategoryBlock, DataBlock
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.data.transforms import GrandparentSplitter, get_image_files, parent_label
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.tabular.all import Categorify, Normalize, TabularDataLoaders, tabular_learner
from fastai.vision.all import ImageBlock, ImageDataLoaders
from torch import nn
from torch.utils.data import TensorDataset

import ddipp
from ddipp.core.checkpoint import DamagedCheckpoint
from ddipp.core.group.group import shutdown
from ddipp.core.rng import seed_all

from conftest import check_restart_said, image_folder, launch_restartable, rank_files, tiny_cnn
from extras import DieWriting, KillRank1, StopAt, ckpt_learner, resume_story
from stories import RunsCode
from compare import TOL, close, max_diff
from dying_fit import DieAfterFit
from fit_story import digits_dls, digits_learner, history, params


@pytest.mark.slow
def test_resumed_fit_ends_with_the_parameters_of_the_uninterrupted_fit_on_2_ranks(extras_ranks):
    (r0, r1), _ = extras_ranks
    for rank in (r0, r1):
        res = rank["resume"]
        assert res["saved_epoch"] == 2
        assert max_diff(res["resumed"]["params"], res["full"]["params"]) <= TOL
        assert close(res["resumed"]["values"], res["full"]["values"])  # the skipped epochs' rows from the file


@pytest.mark.slow
def test_only_rank0_writes_one_file_per_epoch(extras_ranks):
    (r0, r1), out = extras_ranks
    assert [p.rsplit("/", 1)[1] for p in r0["replaced"]] == ["full.pth"] * 4 + ["cut.pth"] * 2 + ["cut.pth"] * 2
    assert r1["replaced"] == []
    assert not list((out / "work" / "models").glob(".*.tmp"))


def test_keep_leaves_the_checkpoints_before_the_last(tmp_path):
    learn = ckpt_learner(tmp_path)
    learn.fit(3, 1e-2, cbs=ddipp.Checkpoint(name="kept", keep=2))
    saved = {p.name: torch.load(p, weights_only=True)["epoch"] for p in (tmp_path / "models").glob("kept*.pth")}
    assert saved == {"kept.pth": 3, "kept.1.pth": 2}


def test_resume_in_one_process(tmp_path):
    res = resume_story(tmp_path)
    assert res["saved_epoch"] == 2
    assert max_diff(res["resumed"]["params"], res["full"]["params"]) == 0
    assert res["resumed"]["values"] == res["full"]["values"]


def test_a_start_epoch_without_its_checkpoint_is_refused_with_the_epoch_to_pass(tmp_path):
    learn = ckpt_learner(tmp_path)
    with pytest.raises(FileNotFoundError, match="start_epoch=1: no checkpoint at .*run.pth; fit from the start"):
        learn.fit(2, 1e-2, start_epoch=1, cbs=ddipp.Checkpoint(name="run"))
    learn.fit(1, 1e-2, cbs=ddipp.Checkpoint(name="run"))
    with pytest.raises(ValueError, match="start_epoch=2, but .*run.pth holds the state after epoch 1; "
                                         "pass start_epoch=1"):
        ckpt_learner(tmp_path).fit(3, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name="run"))


def test_validate_get_preds_and_lr_find_write_no_checkpoint(tmp_path):
    learn = ckpt_learner(tmp_path).add_cb(ddipp.Checkpoint(name="run"))
    learn.validate()
    learn.get_preds()
    learn.lr_find(num_it=5, show_plot=False)
    assert not (tmp_path / "models" / "run.pth").exists()


def test_resuming_reads_the_file_weights_only_so_a_replaced_file_runs_no_code(tmp_path):
    learn = ckpt_learner(tmp_path)
    marker = tmp_path / "code-ran"
    (tmp_path / "models").mkdir()
    torch.save(dict(epoch=2, payload=RunsCode(marker)), tmp_path / "models" / "run.pth")
    with pytest.raises(DamagedCheckpoint, match=r"run\.pth is not a checkpoint ddipp wrote: it holds \S*open, "
                                                r"which a weights-only load refuses") as refused:
        learn.fit_one_cycle(4, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name="run"))
    assert not marker.exists()
    assert "weights_only" not in str(refused.value)  # torch's advice to load it unsafely


def tensor_learner(path: Path) -> Learner:
    """The issue's loader: fastai's DataLoader over a TensorDataset, shuffled; a fastai loss (it returns TensorBase)."""
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    y = (x.sum(1) > 0).long()
    dls = DataLoaders(DataLoader(TensorDataset(x, y), bs=16, shuffle=True), DataLoader(TensorDataset(x, y), bs=16),
                      device="cpu")
    return Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2)),
                   loss_func=CrossEntropyLossFlat(), path=path)


def image_learner(path: Path) -> Learner:
    dls = ImageDataLoaders.from_folder(image_folder(path), bs=8, num_workers=0, device="cpu")
    return Learner(dls, tiny_cnn(), loss_func=CrossEntropyLossFlat(), path=path)


def data_block_learner(path: Path) -> Learner:
    block = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, splitter=GrandparentSplitter(),
                      get_y=parent_label)
    dls = block.dataloaders(image_folder(path), bs=8, num_workers=0, device="cpu")
    return Learner(dls, tiny_cnn(), loss_func=CrossEntropyLossFlat(), path=path)


def tabular_ckpt_learner(path: Path) -> Learner:
    rng = np.random.default_rng(0)
    df = pd.DataFrame(dict(colour=rng.choice(["red", "green", "blue"], 64), size=rng.normal(size=64)))
    df["big"] = (df["size"] > 0).astype(int)
    dls = TabularDataLoaders.from_df(df, path, procs=[Categorify, Normalize], cat_names=["colour"], cont_names=["size"],
                                     y_names="big", y_block=CategoryBlock(), valid_idx=list(range(48, 64)), bs=8,
                                     num_workers=0, device="cpu")
    return tabular_learner(dls, layers=[8], config=dict(ps=0.2))


@pytest.mark.parametrize("make", [tensor_learner, image_learner, data_block_learner, tabular_ckpt_learner])
def test_a_fit_stopped_after_epoch_2_resumes_in_a_plain_process_to_the_weights_of_the_whole_fit(tmp_path, make):
    def fresh(seed: int) -> Learner:
        seed_all(seed)  # the weights, the loaders' own generators, numpy's (the tabular loader shuffles with it)
        return make(tmp_path)
    whole = fresh(0)
    whole.fit_one_cycle(3, 1e-2, cbs=ddipp.Checkpoint(name="whole"))
    fresh(0).fit_one_cycle(3, 1e-2, cbs=[ddipp.Checkpoint(name="cut"), StopAt(2)])
    resumed = fresh(1)  # other weights, draws and order than the stopped fit
    resumed.fit_one_cycle(3, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name="cut"))
    assert max_diff(params(resumed), params(whole)) == 0


class Batches(Callback):
    """The (epoch, iter) of each training batch of a fit."""
    def before_fit(self):
        self.seen = []

    def after_batch(self):
        if self.training:
            self.seen.append((self.epoch, self.iter))


@pytest.mark.parametrize("make", [tensor_learner, image_learner, data_block_learner, tabular_ckpt_learner])
def test_a_fit_stopped_mid_epoch_resumes_at_the_next_batch_to_the_weights_and_recorder_of_the_whole_fit(tmp_path, make):
    def fresh(seed: int) -> Learner:
        seed_all(seed)
        return make(tmp_path)
    whole, whole_batches = fresh(0), Batches()
    whole.fit_one_cycle(3, 1e-2, cbs=[ddipp.Checkpoint(name="whole"), whole_batches])
    fresh(0).fit_one_cycle(3, 1e-2, cbs=[ddipp.Checkpoint(name="cut", every_steps=1), StopAt(1, batch=1)])
    assert torch.load(tmp_path / "models" / "cut.pth", weights_only=True)["step"] == 2
    resumed, resumed_batches = fresh(1), Batches()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        resumed.fit_one_cycle(3, 1e-2, start_epoch=1, cbs=[ddipp.Checkpoint(name="cut", every_steps=1),
                                                          resumed_batches])
    assert not [w for w in warned if "shadowing" in str(w.message)]  # fastai's, of a callback's own attribute
    assert max_diff(params(resumed), params(whole)) == 0
    assert resumed_batches.seen == whole_batches.seen[whole_batches.seen.index((1, 2)):]  # fastai's iter goes on
    assert (resumed.recorder.losses, resumed.recorder.lrs) == (whole.recorder.losses, whole.recorder.lrs)
    assert [row[:2] for row in resumed.recorder.values] == [row[:2] for row in whole.recorder.values]


@pytest.fixture(scope="module")
def whole_restart_run(tmp_path_factory):
    """restart_worker.py's fits uninterrupted, each rank's results."""
    out = tmp_path_factory.mktemp("restarts") / "whole"
    launch_restartable(Path(__file__).parent / "workers" / "restart_worker.py", out, "whole")
    return rank_files(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "kill-shard"])  # sharded: its Checkpoint files are gathered, plain
def test_elastic_restarts_resume_the_cut_fits_by_themselves_as_if_they_never_stopped(tmp_path, whole_restart_run,
                                                                                       mode):
    worker = Path(__file__).parent / "workers" / "restart_worker.py"
    said = launch_restartable(worker, tmp_path / "killed", mode)
    for killed, whole in zip(rank_files(tmp_path / "killed"), whole_restart_run):
        assert (killed["restarts"], whole["restarts"]) == (5, 0)
        assert max_diff(killed["params"], whole["params"]) <= 1e-6
        assert [len(killed["histories"][f]["values"]) for f in (3, 4)] == [1, 3]  # each epoch once
        assert len(killed["histories"][4]["losses"]) == 3 * 20  # each batch once
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


def test_with_gradient_accumulation_a_file_is_written_only_where_an_accumulation_ends(tmp_path):
    def fresh(seed: int) -> Learner:
        seed_all(seed)
        return tensor_learner(tmp_path)
    accumulate = dict(n_acc=32)  # 2 batches of 16 a step
    whole = fresh(0)
    whole.fit_one_cycle(2, 1e-2, cbs=[ddipp.Checkpoint(name="whole"), GradientAccumulation(**accumulate)])
    fresh(0).fit_one_cycle(2, 1e-2, cbs=[ddipp.Checkpoint(name="cut", every_steps=1), StopAt(1, batch=2),
                                         GradientAccumulation(**accumulate)])
    assert torch.load(tmp_path / "models" / "cut.pth", weights_only=True)["step"] == 2  # not 3: batch 2 accumulated
    resumed = fresh(1)
    resumed.fit_one_cycle(2, 1e-2, start_epoch=1, cbs=[ddipp.Checkpoint(name="cut", every_steps=1),
                                                      GradientAccumulation(**accumulate)])
    assert max_diff(params(resumed), params(whole)) == 0


def test_every_steps_refuses_a_recorder_with_training_metrics(tmp_path):
    learn = tensor_learner(tmp_path)
    learn.recorder.train_metrics = True
    with pytest.raises(ValueError, match=r"Checkpoint\(every_steps=2\) cannot resume the training metrics of "
                                         r"Recorder\(train_metrics=True\) in the middle of an epoch"):
        learn.fit(1, cbs=ddipp.Checkpoint(every_steps=2))


@pytest.mark.slow
def test_a_two_node_launch_resumes_from_the_last_whole_checkpoint_when_a_rank_dies_writing_one(tmp_path):
    worker = Path(__file__).parent / "workers" / "nodes_worker.py"
    said = launch_restartable(worker, tmp_path / "killed", "kill", nodes=2)
    launch_restartable(worker, tmp_path / "whole", "whole")
    for killed, whole in zip(rank_files(tmp_path / "killed"), rank_files(tmp_path / "whole")):
        assert (killed["restarts"], whole["restarts"]) == (1, 0)
        assert max_diff(killed["params"], whole["params"]) <= 1e-6
        assert close(killed["history"], whole["history"], tol=1e-6)
    models = tmp_path / "killed" / "work" / "models"
    assert f"ddipp: restart 1: fit 1 resumed after epoch 1 and 10 batches of epoch 2 from {models}" in said
    assert [p.name for p in models.iterdir()] == ["checkpoint.pth"]  # the half-written file was swept


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True])
def test_a_notebook_fit_whose_worker_died_resumes_on_a_new_group_when_restarts_are_asked(tmp_path, capsys, shard):
    shutdown()  # a new group: its first attempt, its fits numbered from 1 (an earlier test may have left one)
    def fit(name: str, *cbs) -> Learner:
        learn = digits_learner(digits_dls(bs=16, shuffle=True), tmp_path).to_ddp(nprocs=2, restarts=2, shard=shard)
        seed_all(0)
        learn.fit_one_cycle(3, 1e-2, cbs=[ddipp.Checkpoint(name, every_steps=6), *cbs])
        return learn
    whole = fit("whole")
    # rank 1 dies before the first checkpoint (the fit runs again from the start), then rank 0 while it writes the
    # checkpoint of batch 15 of epoch 1 (the fit resumes from the one of batch 9)
    killed = fit("cut", KillRank1(0, 3), DieWriting(epoch=1, step=16, attempt=1))
    said = capsys.readouterr()
    assert max_diff(params(killed), params(whole)) <= 1e-6
    assert close(history(killed), history(whole), tol=1e-6)
    check_restart_said(said, tmp_path / "models")
    # on that restarted group, rank 1 dies once the next fit ended: the new group finds it ended, loads its end state
    killed.fit(2, 1e-3, cbs=[ddipp.Checkpoint("ended"), DieAfterFit(tmp_path / "died")])
    ended = torch.load(tmp_path / "models" / "ended.pth", weights_only=True)
    assert killed.epoch == 1 and ended["epoch"] == 2  # fastai's last epoch, as after the fit
    assert max_diff(params(killed), list(ended["model"].values())) == 0
    killed.fit(1, 1e-3, cbs=ddipp.Checkpoint("later"))  # no restart: the group it runs on just ran a fit
    said = capsys.readouterr().out
    restarts = re.findall(r"ddipp: restart \d+: fit \d+ .*", said)
    assert len(restarts) == 1 and restarts[0].endswith(f" had ended before the restart: the state it ended with "
                                                       f"loaded from {tmp_path / 'models' / 'ended.pth'}")
