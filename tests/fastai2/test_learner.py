"""Learner.to_ddp / from_ddp on fastai v2 outside and inside a launched process (the launched fits are in
test_callbacks), and what ddipp's callbacks do in a plain process."""
import pytest
import torch
from fastai.data.core import DataLoaders, Datasets
from fastai.data.load import DataLoader
from fastai.learner import Learner, load_learner
from fastai.metrics import AccumMetric, mae
from torch.utils.data import TensorDataset

import ddipp
from ddipp import DistributedCallback, GCCallback, LRFinderBypassCallback

DDIPP = (DistributedCallback, LRFinderBypassCallback, GCCallback)
mae_metric = AccumMetric(mae)  # fastai gathers its predictions and targets through learn.to_detach


@pytest.fixture
def learn(tmp_path):
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    dls = DataLoaders(DataLoader(ds, bs=4), DataLoader(ds, bs=4), path=tmp_path, device="cpu")
    return Learner(dls, torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())


@pytest.fixture
def launched(monkeypatch):
    """A process that looks launched (rank 0 of 2) and whose group is joined."""
    monkeypatch.setattr(ddipp.core.dist, "launched", lambda: True)
    monkeypatch.setattr(ddipp.core.dist, "init", lambda: True)


def _ddipp_callbacks(learn):
    return [type(cb) for cb in learn.cbs if isinstance(cb, DDIPP)]


def test_to_ddp_is_a_no_op_in_a_plain_process(learn, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    before = list(learn.cbs)
    assert learn.to_ddp() is learn and list(learn.cbs) == before and "fit" not in vars(learn)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nprocs=0), "to_ddp(nprocs=0): nprocs is the number of CPU processes, a whole number >= 1"),
    (dict(gpus=[0], nprocs=2), "to_ddp(gpus=[0], nprocs=2): give gpus for GPUs or nprocs for CPU processes, not both"),
    (dict(gpus=3), "to_ddp(gpus=3): gpus is a list of GPU indices, e.g. gpus=[0, 1]"),
    (dict(gpus=[0, 1]), "to_ddp(gpus=[0, 1]): this host has no GPU; use to_ddp(nprocs=N) to run N CPU processes")])
def test_to_ddp_in_a_notebook_refuses_bad_devices_naming_the_fix(learn, monkeypatch, kwargs, message):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError) as raised:
        learn.to_ddp(**kwargs)
    assert str(raised.value) == message and "ddp" not in vars(learn)


def test_to_ddp_attaches_the_callbacks_once_and_from_ddp_removes_them(learn, launched):
    assert learn.to_ddp().to_ddp() is learn
    assert _ddipp_callbacks(learn) == [DistributedCallback, LRFinderBypassCallback, GCCallback]
    assert {"fit", "save", "export"} <= set(vars(learn))  # the fit guard, the atomic save and export
    assert learn.from_ddp() is learn and _ddipp_callbacks(learn) == []
    assert not {"fit", "save", "export"} & set(vars(learn))


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=[0, 3]), "to_ddp(gpus=[0, 3]) but the launcher started this group on cpu; pass the same gpus or "
                        "leave gpus out"),
    (dict(nprocs=3), "to_ddp(nprocs=3) but the launcher started 2 processes on this host; pass the same number or "
                     "leave nprocs out"),
    (dict(restarts=2), "to_ddp(restarts=2) restarts a notebook's workers; the launcher restarts a launched script: "
                       "python -m ddipp.launch --max-restarts 2 ..., and leave restarts out")])
def test_to_ddp_in_a_launched_process_refuses_devices_the_launcher_did_not_start(learn, monkeypatch, kwargs, message):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", DDIPP_DEVICES="cpu").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:
        learn.to_ddp(**kwargs)
    assert str(raised.value) == message and _ddipp_callbacks(learn) == []


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, message", [
    (dict(timeout=0), "to_ddp(timeout=0): timeout is the seconds a rank may wait for the others, a number > 0 "
                      "(default 600)"),
    (dict(timeout=-5), "to_ddp(timeout=-5): timeout is the seconds"),
    (dict(timeout="60"), "to_ddp(timeout='60'): timeout is the seconds"),
    (dict(lr_find_mode="bogus"), "to_ddp(lr_find_mode='bogus'): use 'solo' (rank 0 sweeps alone) or 'distributed' "
                                 "(all ranks sweep with the global batch)"),
    (dict(restarts=-1), "to_ddp(restarts=-1): restarts is how many times a notebook fit whose worker died starts a "
                        "new group and resumes from its Checkpoint, a whole number >= 0 (default 0)"),
    (dict(restarts=True), "to_ddp(restarts=True): restarts is how many times")])
def test_to_ddp_names_bad_options_before_changing_anything(learn, kwargs, message):
    with pytest.raises(ValueError) as raised:
        learn.to_ddp(nprocs=2, **kwargs)
    assert str(raised.value).startswith(message) and _ddipp_callbacks(learn) == []


def test_lr_find_bypass_names_the_allowed_modes():
    with pytest.raises(ValueError, match="mode='global'.*'solo'.*'distributed'"):
        LRFinderBypassCallback(mode="global")


def test_the_callbacks_train_as_fastai_does_in_a_plain_process(learn, tmp_path):
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    plain = Learner(DataLoaders(DataLoader(ds, bs=4), DataLoader(ds, bs=4), path=tmp_path, device="cpu"),
                    torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())
    torch.nn.init.zeros_(plain.model.weight)
    torch.nn.init.zeros_(learn.model.weight)
    torch.nn.init.zeros_(plain.model.bias)
    torch.nn.init.zeros_(learn.model.bias)
    learn.dls = DataLoaders(DataLoader(ds, bs=4), DataLoader(ds, bs=4), path=tmp_path, device="cpu")
    learn.add_cbs([DistributedCallback(), LRFinderBypassCallback(), GCCallback()])
    for lr in (plain, learn):
        lr.fit(2, 1e-2)
    assert torch.equal(plain.model.weight, learn.model.weight)
    assert plain.recorder.values == learn.recorder.values and learn.validate() == plain.validate()


def test_a_fit_guard_follows_the_distributed_callback(learn):
    cb = DistributedCallback()
    learn.add_cb(cb)
    assert vars(learn)["fit"].callback is cb
    learn.remove_cb(cb)
    assert "fit" not in vars(learn)


def test_a_launched_learners_save_replaces_its_file_only_once_whole(learn, launched, monkeypatch):
    learn.to_ddp()
    path = learn.save("best")
    before = torch.load(path)["weight"].clone()
    with torch.no_grad():
        learn.model.weight.add_(1)

    def crash(obj, f, **kwargs):
        f.write(b"half a model")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        learn.save("best")
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["weight"], before)  # fastai's own save leaves 12 bytes here
    assert sorted(p.name for p in path.parent.iterdir()) == ["best.pth"]


def _xs(i):
    return torch.tensor([float(i), 1.0])


def _ys(i):
    return torch.tensor([float(i) / 2])


def test_a_launched_learner_exports_a_plain_learner_atomically(tmp_path, launched, monkeypatch):
    dls = Datasets(list(range(8)), tfms=[[_xs], [_ys]], splits=[list(range(6)), [6, 7]]).dataloaders(
        bs=2, path=tmp_path, device="cpu")  # fastai's Datasets: export keeps an empty copy of them
    learn = Learner(dls, torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss()).to_ddp()
    learn.export("model.pkl")
    loaded = load_learner(learn.path / "model.pkl")
    assert _ddipp_callbacks(loaded) == [] and "fit" not in vars(loaded) and "save" not in vars(loaded)
    assert torch.equal(loaded.model.weight, learn.model.weight)
    assert _ddipp_callbacks(learn) == [DistributedCallback, LRFinderBypassCallback, GCCallback]  # put back

    def crash(obj, f, **kwargs):
        open(f, "wb").write(b"half a learner")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        learn.export("model.pkl")
    monkeypatch.undo()
    assert torch.equal(load_learner(learn.path / "model.pkl").model.weight, learn.model.weight)
    assert sorted(p.name for p in learn.path.iterdir()) == ["model.pkl"]


def test_validate_and_get_preds_outside_a_fit_need_no_other_rank(tmp_path, launched, monkeypatch):
    def make():
        torch.manual_seed(0)
        x = torch.randn(9, 2)
        ds = TensorDataset(x, x.sum(1, keepdim=True))
        dls = DataLoaders(DataLoader(ds, bs=4), DataLoader(ds, bs=4), path=tmp_path, device="cpu")
        return Learner(dls, torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss(), metrics=[mae_metric])
    plain = make()
    expected, expected_preds = plain.validate(), plain.get_preds()
    learn = make().to_ddp()
    for name, value in dict(RANK="0", WORLD_SIZE="2").items():  # fastai gathers across ranks when WORLD_SIZE > 1
        monkeypatch.setenv(name, value)
    assert not torch.distributed.is_initialized()  # a gather would raise: no other rank is there
    assert learn.validate() == expected
    preds = learn.get_preds()
    assert torch.equal(preds[0], expected_preds[0]) and preds[0].shape == (9, 1)
