"""Learner.to_ddp / from_ddp outside and inside a launched process (the launched fits are in test_callbacks,
the notebook fits in tests/interactive); what a launched learner's save, export and validate are (the `ranks` run)."""
import io
import os
import subprocess
import sys

import pytest
import torch

import ddipp
from ddipp import DistributedCallback, GCCallback, LRFinderBypassCallback
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner, load_learner
from torch.utils.data import DataLoader, TensorDataset

from conftest import WITHOUT_DDIPP
from compare import max_diff
from scenario import method_facts, params, tabular_digits_learner


@pytest.fixture
def learn(tmp_path):
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    data = DataBunch(DataLoader(ds, 4), DataLoader(ds, 4), path=tmp_path, device=torch.device("cpu"), no_check=True)
    return Learner(data, torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())


def _ddipp_callbacks(learn):
    return [getattr(f, "func", f) for f in learn.callback_fns
            if getattr(f, "func", f) in (DistributedCallback, LRFinderBypassCallback, GCCallback)]


def test_to_ddp_is_a_no_op_in_a_plain_process(learn, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    before = list(learn.callback_fns)
    assert learn.to_ddp() is learn and learn.callback_fns == before


def test_to_ddp_attaches_the_callbacks_once_and_from_ddp_removes_them(learn, monkeypatch):
    monkeypatch.setattr(ddipp.core.dist, "launched", lambda: True)
    monkeypatch.setattr(ddipp.core.dist, "init", lambda: True)
    learn.to_ddp().to_ddp()
    assert _ddipp_callbacks(learn) == [DistributedCallback, LRFinderBypassCallback, GCCallback]
    assert learn.from_ddp() is learn and _ddipp_callbacks(learn) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=[0, 3]), "to_ddp(gpus=[0, 3]) but the launcher started this group on cpu"),
    (dict(nprocs=3), "to_ddp(nprocs=3) but the launcher started 2 processes"),
    (dict(restarts=1), "to_ddp(restarts=1) restarts a notebook's workers; the launcher restarts a launched script")])
def test_to_ddp_in_a_launched_process_refuses_devices_the_launcher_did_not_start(learn, monkeypatch, kwargs, message):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", DDIPP_DEVICES="cpu").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        learn.to_ddp(**kwargs)


def test_lr_find_bypass_names_the_allowed_modes(learn):
    with pytest.raises(ValueError, match="mode='global'.*'solo'.*'distributed'"):
        LRFinderBypassCallback(learn, mode="global")


@pytest.mark.parametrize("kwargs, gpu_count, message", [
    (dict(gpus=[0, 0]), 4, "to_ddp(gpus=[0, 0]): GPU 0 listed twice; give each GPU once, e.g. gpus=[0, 1]"),
    (dict(gpus=[1, 5]), 4, "to_ddp(gpus=[1, 5]): GPU 5 does not exist; this host has 4 GPUs (0-3)"),
    (dict(gpus=[0]), 0, "to_ddp(gpus=[0]): this host has no GPU; use to_ddp(nprocs=N) to run N CPU processes"),
    (dict(gpus="0,1"), 4, "to_ddp(gpus='0,1'): gpus is a list of GPU indices, e.g. gpus=[0, 1]"),
    (dict(gpus=[]), 4, "to_ddp(gpus=[]): gpus is a list of GPU indices, e.g. gpus=[0, 1]"),
    (dict(gpus=[0], nprocs=2), 4, "to_ddp(gpus=[0], nprocs=2): give gpus for GPUs or nprocs for CPU processes, "
                                  "not both"),
    (dict(nprocs=0), 0, "to_ddp(nprocs=0): nprocs is the number of CPU processes, a whole number >= 1")])
def test_to_ddp_in_a_notebook_names_bad_devices_before_starting_anything(learn, monkeypatch, kwargs, gpu_count,
                                                                         message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_count)
    with pytest.raises(ValueError) as raised:
        learn.to_ddp(**kwargs)
    assert str(raised.value) == message and "ddp" not in vars(learn)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nprocs=2, timeout=0), "to_ddp(timeout=0): timeout is the seconds a rank may wait for the others, "
                                "a number > 0 (default 600)"),
    (dict(nprocs=2, timeout=-5), "to_ddp(timeout=-5): timeout is the seconds"),
    (dict(nprocs=2, timeout="60"), "to_ddp(timeout='60'): timeout is the seconds"),
    (dict(nprocs=2, lr_find_mode="bogus"), "to_ddp(lr_find_mode='bogus'): use 'solo' (rank 0 sweeps alone) or "
                                           "'distributed' (all ranks sweep with the global batch)"),
    (dict(nprocs=True), "to_ddp(nprocs=True): nprocs is the number of CPU processes, a whole number >= 1"),
    (dict(gpus=[True]), "to_ddp(gpus=[True]): gpus is a list of GPU indices")])
def test_to_ddp_names_bad_options_before_starting_anything(learn, kwargs, message):
    with pytest.raises(ValueError) as raised:
        learn.to_ddp(**kwargs)
    assert str(raised.value).startswith(message) and "ddp" not in vars(learn)


def test_a_launched_learners_save_replaces_its_file_only_once_whole(learn, monkeypatch):
    monkeypatch.setattr(ddipp.core.dist, "launched", lambda: True)
    monkeypatch.setattr(ddipp.core.dist, "init", lambda: True)
    learn.to_ddp()
    path = learn.save("best", return_path=True)
    before = torch.load(path)["weight"].clone()
    with torch.no_grad():
        learn.model.weight.add_(1)

    def crash(obj, f):
        f.write(b"half a model")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        learn.save("best")
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["weight"], before)  # fastai's own save leaves 12 bytes here
    assert sorted(p.name for p in path.parent.iterdir()) == ["best.pth"]
    learn.from_ddp()
    assert "save" not in vars(learn)


def test_a_launched_learners_save_of_a_compiled_model_loads_into_the_plain_model(learn, monkeypatch):
    monkeypatch.setattr(ddipp.core.dist, "launched", lambda: True)
    monkeypatch.setattr(ddipp.core.dist, "init", lambda: True)
    plain = learn.model
    learn.model = torch.compile(plain, backend="eager")
    learn.to_ddp()
    path = learn.save("compiled", return_path=True, with_opt=False)
    assert learn.model is not plain  # still the compiled model after the save
    fresh = torch.nn.Linear(2, 1)
    fresh.load_state_dict(torch.load(path))  # fastai's own save writes "_orig_mod.weight"
    assert torch.equal(fresh.weight, plain.weight)


@pytest.mark.slow
def test_a_launched_learners_validate_save_and_export_are_fastais_bound_methods(ranks, learn):
    plain = {name: method_facts(getattr(learn, name)) for name in ("validate", "save", "export")}
    assert all(facts["method"] for facts in plain.values())
    for rank in ranks[0]:
        assert rank["exported"]["methods"] == plain


@pytest.mark.slow
def test_save_and_export_to_a_buffer_give_every_rank_the_bytes(ranks, tmp_path):
    (r0, r1), _ = ranks
    trained = r0["exported"]["trained"]
    for rank in (r0, r1):
        learn = tabular_digits_learner(tmp_path)
        assert len(rank["exported"]["saved"]) and len(rank["exported"]["exported"])
        learn.load(io.BytesIO(rank["exported"]["saved"].numpy().tobytes()))
        assert max_diff(params(learn), trained) == 0
        (tmp_path / "export.pkl").write_bytes(rank["exported"]["exported"].numpy().tobytes())
        assert max_diff(params(load_learner(tmp_path, "export.pkl")), trained) == 0


# An exported learner loaded by plain fastai where ddipp cannot be imported (with torch's full load, which fastai
# 1.0.61 expects of torch.load); its weights saved to the file named last.
LOAD_WITHOUT_DDIPP = WITHOUT_DDIPP + """
import torch
from fastai.basic_train import load_learner
folder, name, out = sys.argv[1:]
learn = load_learner(folder, name)
assert "ddipp" not in sys.modules
torch.save([p.detach() for p in learn.model.parameters()], out)
"""


@pytest.mark.slow
def test_a_launched_export_loads_where_ddipp_is_not_installed(ranks, tmp_path):
    (r0, _), out = ranks
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_DDIPP, str(out / "work"), "final.pkl",
                           str(tmp_path / "loaded.pt")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_diff(torch.load(tmp_path / "loaded.pt"), r0["exported"]["trained"]) == 0


@pytest.mark.slow
def test_a_launched_rank_s_fastai_device_is_ddipps(beyond_ranks):
    (r0, r1), _ = beyond_ranks
    assert r0["device"] == r0["fastai_device"] == r1["device"] == r1["fastai_device"] == "cpu"
