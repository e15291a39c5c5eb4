"""Notebook mode: a learner bound with to_ddp(nprocs=2) in this plain process fits on a worker group and
gets back what a launched run and one process (the `ranks` and `reference` fixtures) get."""
import io
import pickle
import re
import threading
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from fastai.basic_train import LearnerCallback
from fastai.callback import Callback
from fastai.callbacks import (CSVLogger, EarlyStoppingCallback, LossMetrics, OverSamplingCallback,
                              ReduceLROnPlateauCallback, SaveModelCallback, TerminateOnNaNCallback)
from fastai.train import AccumulateScheduler, BnFreeze, GradientClipping, ShowGraph
from torch import nn

from ddipp import Checkpoint
from ddipp.core.group.binding import FitOnGroup
from ddipp.core.group.group import _groups
from ddipp.fastai1.notebook import binding as notebook_binding
from ddipp.fastai1.notebook.fitting import apply_results
from compare import TOL, close, max_diff
from scenario import (between_fits, digits_data, digits_learner, history, opt_state, params, story,
                      tabular_digits_learner)

CPU2 = ("cpu", "cpu")


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The scenario's story played by a notebook-mode learner (per-rank batch 16), and the workers' pids."""
    learn = digits_learner(digits_data(tmp_path_factory.mktemp("nb"), bs=16)).to_ddp(nprocs=2)
    pids = [p.pid for p in _groups[CPU2].procs]
    res = story(learn)
    res["pids"] = pids, [p.pid for p in _groups[CPU2].procs]
    return res


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["params_fit", "params_frozen", "params_unfrozen", "params_loaded"])
def test_the_notebook_learner_gets_the_weights_a_launched_run_and_one_process_train(notebook, ranks, reference,
                                                                                     stage):
    (r0, _), _ = ranks
    assert max_diff(notebook[stage], r0["story"][stage]) == 0
    assert max_diff(notebook[stage], reference[stage]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["fit", "fit_frozen", "fit_unfrozen", "sweep_before", "sweep_after"])
def test_the_notebook_recorder_is_the_launched_one(notebook, ranks, stage):
    (r0, _), _ = ranks
    assert notebook[stage] == r0["story"][stage]


@pytest.mark.slow
def test_validate_and_get_preds_in_the_notebook_after_remote_fits(notebook, reference):
    assert notebook["plot"] and notebook["restored"]
    assert close(notebook["validate"], reference["validate"])
    assert max_diff([notebook["preds"]], [reference["preds"]]) <= TOL


@pytest.mark.slow
def test_fits_reuse_the_same_workers(notebook):
    started, finished = notebook["pids"]
    assert started == finished and len(set(started)) == 2


@pytest.mark.slow
def test_changes_made_between_fits_are_honoured(tmp_path):
    group_fits = between_fits(digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2), bs=16)
    single = between_fits(digits_learner(digits_data(tmp_path / "one", bs=32)), bs=32)
    assert group_fits["batches"] == single["batches"] == 2 * ((1797 - 101) // 32)  # the last fit: 2 epochs
    assert len(group_fits["metrics"][-1]) == 3  # accuracy, FBeta and the lambda, over 101 items
    assert close({k: v for k, v in group_fits.items() if k not in ("params", "opt_state")},
                 {k: v for k, v in single.items() if k not in ("params", "opt_state")})
    assert max_diff(group_fits["params"], single["params"]) <= TOL
    assert max_diff(group_fits["opt_state"], single["opt_state"]) <= TOL  # Adam's moments came back too


@pytest.mark.slow
def test_a_notebook_that_seeds_torch_gets_the_same_numbers_run_after_run(tmp_path):
    def seeded_run():
        learn = digits_learner(digits_data(tmp_path, bs=16, shuffle=True)).to_ddp(nprocs=2)
        torch.manual_seed(7)
        learn.fit(1, 1e-2)
        return params(learn)
    assert max_diff(seeded_run(), seeded_run()) == 0


class RefusesOptimizers(pickle.Unpickler):
    """Reads a part of a fit's results, any optimizer object in it refused (references read as None)."""

    def persistent_load(self, pid):
        return None

    def find_class(self, module, name):
        if (module, name) == ("fastai.callback", "OptimWrapper") or module.startswith("torch.optim"):
            raise pickle.UnpicklingError(f"the results hold a {module}.{name}")
        return super().find_class(module, name)


@pytest.mark.slow
def test_unchanged_data_is_sent_once(tmp_path, monkeypatch):
    """Unchanged data is sent once; the optimizer object never travels back: its state comes into the learner's own,
    which stays the object the first fit made, with a local fit's state and hyper-parameters."""
    weights = []  # the first part of each fit's results: the weights and the optimizer's state
    monkeypatch.setattr(notebook_binding, "apply_results",
                        lambda learn, parts, *args: weights.append(parts[0]) or apply_results(learn, parts, *args))
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    local = digits_learner(digits_data(tmp_path, bs=32))
    group = _groups[CPU2]
    learn.fit(1, 1e-2)
    local.fit(1, 1e-2)
    first, opt = group.last_sent, learn.opt
    assert learn.recorder.opt is learn.opt  # as after a local fit: one optimizer, not a copy per part of the results
    learn.fit(1, 1e-3)
    local.fit(1, 1e-3)
    again = group.last_sent
    learn.data = digits_data(tmp_path, bs=16)  # an equal copy: nothing to send either
    learn.fit(1, 1e-2)
    local.fit(1, 1e-2)
    assert first["data"] > 400_000 and again["data"] == 0 and group.last_sent["data"] == 0
    assert 0 < again["call"] < first["data"] / 10
    assert learn.opt is opt and learn.recorder.opt is opt and close(opt_state(learn), opt_state(local))
    moments = [[s["exp_avg"] for s in (l.opt.opt.state[p] for p in l.model.parameters())] for l in (learn, local)]
    assert len(moments[0]) == len(moments[1]) == 4 and max_diff(*moments) <= TOL
    assert len(weights) == 3 and all(RefusesOptimizers(io.BytesIO(part)).load()["state"]["opt"] for part in weights)


@pytest.mark.slow
def test_rank0_prints_and_the_results_table_show_here_like_a_local_fit(tmp_path, capsys):
    import ddipp
    from fastai.basic_train import LearnerCallback

    class Hello(LearnerCallback):
        def on_train_begin(self, **kwargs):
            print(f"hello from rank {ddipp.rank()}")

    local = digits_learner(digits_data(tmp_path, bs=32))
    local.callback_fns.append(Hello)
    local.fit(2, 1e-2)
    local_out = capsys.readouterr().out
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    learn.callback_fns.append(Hello)
    learn.fit(2, 1e-2)
    remote_out = capsys.readouterr().out
    assert remote_out.count("hello from rank 0") == 1 and "hello from rank 1" not in remote_out

    header = "epoch     train_loss  valid_loss  accuracy  batch_max_prob  f_beta    time"
    assert remote_out.count(header) == local_out.count(header) == 1

    def epochs(out):  # the first column of the table's rows
        return re.findall(r"(\d+) +\d+\.\d{6} +\d+\.\d{6} +\d\.\d{6} +\d\.\d{6} +\d\.\d{6} +\d\d:\d\d", out)
    assert epochs(remote_out) == epochs(local_out) == ["0", "1"]
    assert "Epoch 2/2" in remote_out and "[44/44" in remote_out  # the console bars, with rank 0's batches


@pytest.mark.slow
def test_a_language_model_trains_in_notebook_mode_as_one_process_does(tmp_path):
    import apps  # the text task of tests/test_apps.py (tests/workers)

    def trained(learn):
        learn.callback_fns.append(apps.ResetBeforeValidation)
        learn.fit_one_cycle(4, 2e-2)
        return float(learn.recorder.metrics[-1][0])
    notebook = trained(apps.lm_learner(tmp_path / "nb", bs=16).to_ddp(nprocs=2))  # 2 ranks × 16 streams
    one = trained(apps.lm_learner(tmp_path / "one", bs=32))
    assert abs(notebook - one) <= 0.03 and notebook >= 0.70, (notebook, one)  # tests/test_apps.py's bar for LM


# Every callback of fastai.callbacks / fastai.train a user adds: a notebook-mode fit (2 ranks of 16) against a
# local fit of the same learner on the global batch (32): weights, recorder, files written.

class TwoPartLoss(nn.Module):
    """A loss that reports its parts to fastai's LossMetrics."""
    metric_names = ["ce", "l2"]

    def forward(self, out, target):
        ce, l2 = F.cross_entropy(out, target), out.pow(2).mean() * 1e-3
        self.metrics = dict(ce=ce, l2=l2)
        return ce + l2


def _nan_at(data, index):
    """`data` with one training item that makes its batch's loss NaN."""
    data.train_dl.dl.dataset.tensors[0][index] = float("nan")
    return data


def _bn_model(learn):
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    learn.train_bn = False  # the frozen group's BatchNorm too: BnFreeze keeps its statistics
    learn.split([learn.model[3]]).freeze()


CALLBACKS = {  # name -> (set up the learner, fit it)
    "ShowGraph": (lambda learn: learn.callback_fns.append(ShowGraph), lambda learn: learn.fit(2, 1e-2)),
    "CSVLogger": (lambda learn: learn.callback_fns.append(CSVLogger), lambda learn: learn.fit(2, 1e-2)),
    "SaveModelCallback-epoch": (lambda learn: learn.callback_fns.append(partial(SaveModelCallback, every="epoch")),
                                lambda learn: learn.fit(2, 1e-2)),
    "SaveModelCallback-improvement": (
        lambda learn: learn.callback_fns.append(partial(SaveModelCallback, every="improvement", name="best")),
        lambda learn: learn.fit(2, 1e-2)),
    "EarlyStoppingCallback": (lambda learn: learn.callback_fns.append(partial(EarlyStoppingCallback, patience=0,
                                                                              min_delta=0.3)),
                              lambda learn: learn.fit(5, 1e-2)),
    "ReduceLROnPlateauCallback": (
        lambda learn: learn.callback_fns.append(partial(ReduceLROnPlateauCallback, patience=0, min_delta=0.3,
                                                        factor=0.5)),
        lambda learn: learn.fit(3, 1e-2)),
    "TerminateOnNaNCallback": (lambda learn: _nan_at(learn.data, 200),
                               lambda learn: learn.fit(2, 1e-2, callbacks=[TerminateOnNaNCallback()])),
    "GradientClipping": (lambda learn: learn.callback_fns.append(partial(GradientClipping, clip=0.01)),
                         lambda learn: learn.fit(2, 1e-2)),
    "BnFreeze": (lambda learn: (_bn_model(learn), learn.callback_fns.append(BnFreeze)),
                 lambda learn: learn.fit(2, 1e-2)),
    "AccumulateScheduler": (lambda learn: (setattr(learn, "loss_func", nn.CrossEntropyLoss(reduction="sum")),
                                           learn.callback_fns.append(partial(AccumulateScheduler, n_step=3))),
                            lambda learn: learn.fit(2, 1e-3)),  # a sum over 32 items: 1e-2 would make 3e-5 of 1e-7
    "LossMetrics": (lambda learn: (setattr(learn, "loss_func", TwoPartLoss()), learn.callback_fns.append(LossMetrics)),
                    lambda learn: learn.fit(2, 1e-2)),
    "GeneralScheduler-fit_fc": (lambda learn: None, lambda learn: learn.fit_fc(2, 1e-2)),
}


def _nan_free(numbers):
    """`numbers` (nested lists and dicts of floats) with None for NaN, so that NaN equals NaN."""
    if isinstance(numbers, dict):
        return {k: _nan_free(v) for k, v in numbers.items()}
    if isinstance(numbers, list):
        return [_nan_free(v) for v in numbers]
    return None if isinstance(numbers, float) and np.isnan(numbers) else numbers


def _trained(path, bs, setup, fit, bound):
    learn = digits_learner(digits_data(path, bs=bs))
    setup(learn)
    if bound:
        learn.to_ddp(nprocs=2)
    fit(learn)
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return learn, files


@pytest.mark.slow
@pytest.mark.parametrize("name", CALLBACKS)
def test_a_fastai_callback_in_a_notebook_fit_gives_what_a_local_fit_gives(tmp_path, name):
    setup, fit = CALLBACKS[name]
    local, local_files = _trained(tmp_path / "local", 32, setup, fit, bound=False)
    remote, remote_files = _trained(tmp_path / "nb", 16, setup, fit, bound=True)
    assert remote_files == local_files
    for a, b in zip(params(remote) + list(remote.model.buffers()), params(local) + list(local.model.buffers())):
        assert torch.allclose(a.float(), b.float(), atol=TOL, equal_nan=True), name
    assert close(_nan_free(history(remote)), _nan_free(history(local)), tol=1e-4)
    for file in local_files:
        if file.endswith(".pth"):
            got, want = (torch.load(tmp_path / side / file)["model"] for side in ("nb", "local"))
            assert max_diff(list(got.values()), list(want.values())) <= TOL
        elif file.endswith(".csv"):
            got, want = (pd.read_csv(tmp_path / side / file).drop(columns="time") for side in ("nb", "local"))
            assert np.allclose(got.values, want.values, atol=1e-4)


@pytest.mark.slow
def test_mixup_in_a_notebook_fit_trains_as_a_local_fit_does(tmp_path):
    def accuracy_after(learn):
        learn.mixup().fit(4, 1e-2)
        return float(learn.recorder.metrics[-1][0])
    remote = accuracy_after(digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2))
    local = accuracy_after(digits_learner(digits_data(tmp_path / "local", bs=32)))
    assert abs(remote - local) <= 0.03, (remote, local)  # the mixed pairs differ: within a rank's batch


@pytest.mark.slow
@pytest.mark.parametrize("name, message", [
    ("OverSamplingCallback", "OverSamplingCallback would make every rank draw its own sample"),
    ("AccumulateScheduler-mean", "AccumulateScheduler with a loss of reduction='mean'")])
def test_a_callback_that_cannot_work_under_ddp_is_refused_before_the_first_step(tmp_path, name, message):
    learn = tabular_digits_learner(tmp_path) if name == "OverSamplingCallback" else digits_learner(
        digits_data(tmp_path, bs=16))
    learn.callback_fns.append(OverSamplingCallback if name == "OverSamplingCallback" else AccumulateScheduler)
    learn.to_ddp(nprocs=2)
    before = params(learn)
    with pytest.raises(ValueError, match=re.escape(message)):
        learn.fit(1, 1e-2)
    assert max_diff(params(learn), before) == 0


@pytest.mark.slow
def test_the_global_batch_is_said_at_binding_and_again_when_the_batch_size_changes(tmp_path, capsys):
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    learn.fit(1, 1e-2)
    learn.fit(1, 1e-2)
    out = capsys.readouterr().out
    assert out.count("ddipp: global batch 32 = 16 per process x 2 (an epoch takes 1/2 of the steps of one process "
                     "with bs=16); add split_batches=True to keep bs=16 as the global batch") == 1
    learn.data = digits_data(tmp_path, bs=8)
    learn.fit(1, 1e-2)
    assert capsys.readouterr().out.count("ddipp: global batch 16 = 8 per process x 2 (an epoch takes 1/2") == 1
    learn.data = digits_data(tmp_path, bs=8)  # another loader, the same batch size: nothing new to say
    learn.fit(1, 1e-2)
    assert "ddipp: global batch" not in capsys.readouterr().out
    learn.to_ddp(nprocs=2)  # a new binding says it again
    assert capsys.readouterr().out.count("ddipp: global batch 16") == 1


class StepCounter(Callback):
    """Counts the optimizer steps of the fits it is given to."""

    def __init__(self):
        self.n = 0

    def on_step_end(self, **kwargs):
        self.n += 1


class LearnerStepCounter(LearnerCallback):
    """A StepCounter that is also `learn.learner_step_counter`, as fastai's LearnerCallbacks are."""

    def __init__(self, learn):
        super().__init__(learn)
        self.n = 0

    def on_step_end(self, **kwargs):
        self.n += 1


class LockingStepCounter(StepCounter):
    """A StepCounter that ends its fit holding what cannot be pickled."""

    def on_train_end(self, **kwargs):
        self.lock = threading.Lock()


@pytest.mark.slow
def test_a_callback_given_to_one_fit_comes_back_with_what_the_fit_did_to_it(tmp_path, capsys):
    def counted(learn):
        counters = [StepCounter(), LearnerStepCounter(learn)]
        learn.fit(2, 1e-2, callbacks=counters)
        learn.fit(1, 1e-2, callbacks=counters)  # counts on from where the first fit left it
        assert learn.learner_step_counter is counters[1] and counters[1].learn is learn
        locking = LockingStepCounter()
        learn.fit(1, 1e-2, callbacks=[locking])
        return counters + [locking]
    local = counted(digits_learner(digits_data(tmp_path / "one", bs=32)))
    learn = digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2)
    remote = counted(learn)
    assert [c.n for c in remote] == [c.n for c in local] == [3 * 44, 3 * 44, 44]  # 44 steps of 32 (2 ranks x 16)
    assert remote[2].lock is None and "ddipp: callbacks[0] of the fit came back with lock set to None: it cannot be " \
        "pickled" in capsys.readouterr().err


def _rebuilt_between_fits(learn):
    """Fits with fastai's purge and load(purge=True) between them, which rebuild the learner's attributes: whether
    the learner was bound before each fit after a rebuild, and its weights after each."""
    learn.fit(1, 1e-2)
    learn.save("first")
    bound, weights = [], []
    for rebuild in (learn.purge, partial(learn.load, "first", purge=True)):
        rebuild()
        bound.append(isinstance(vars(learn).get("fit"), FitOnGroup) and "ddp" in vars(learn))
        learn.fit(1, 1e-2)
        weights += params(learn)
    return bound, weights


@pytest.mark.slow
def test_the_binding_survives_purge_and_load_with_purge(tmp_path):
    bound, remote = _rebuilt_between_fits(digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2))
    _, local = _rebuilt_between_fits(digits_learner(digits_data(tmp_path / "one", bs=32)))
    assert bound == [True, True]
    assert max_diff(remote, local) <= 10 * TOL  # summation order over 3 epochs (1.7e-5 here); a fit in this process
    # would have trained on steps of 16, not 32


@pytest.mark.slow
def test_destroy_takes_the_learner_off_its_workers_and_says_so(tmp_path, capsys):
    other = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)  # keeps the workers for the next tests
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    group = _groups[CPU2]
    learn.destroy()
    out = capsys.readouterr().out
    assert "ddipp: the destroyed learner left its workers; they stay for the other learners bound to them" in out
    assert group.alive and id(learn) not in group.learners and group.learners[id(other)] is other
    plain = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2).from_ddp()
    assert not {"ddp", "fit", "purge", "destroy"} & set(vars(plain))  # fastai's own methods again


@pytest.mark.slow
def test_a_distributed_sweep_in_the_notebook_runs_its_num_it_steps_to_end_lr(tmp_path):
    from scenario import sweep
    learn = digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2, lr_find_mode="distributed")
    notebook = sweep(learn, num_it=100)  # fastai plans 2 epochs here (no WORLD_SIZE in the notebook): 88 steps a rank
    single = sweep(digits_learner(digits_data(tmp_path / "one", bs=32)), num_it=100)
    assert len(notebook["lrs"]) == len(single["lrs"]) == 100 and notebook["lrs"][-1] > 8
    assert close(notebook["lrs"], single["lrs"]) and notebook["kept_weights"]
    assert close(notebook["losses"], single["losses"], tol=1e-3)  # summation order shows at lrs of 5 to 8: 4e-5


class ReadsTheModel(LearnerCallback):
    """Reads the model's own attribute through the learner each training step, as callbacks read a custom head's."""

    def on_train_begin(self, **kwargs):
        self.seen = []

    def on_batch_end(self, train, **kwargs):
        if train:
            self.seen.append(self.learn.model.label)


@pytest.mark.slow
def test_a_callback_reads_the_models_attributes_through_the_ddp_wrapper_as_locally(tmp_path):
    seen = []
    for learn in (digits_learner(digits_data(tmp_path / "one", bs=32)),
                  digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2)):
        learn.model.label = "digits"
        callback = ReadsTheModel(learn)
        learn.fit(1, 1e-2, callbacks=[callback])
        seen.append(callback.seen)
    assert seen[1] == seen[0] == ["digits"] * 44


@pytest.mark.slow
def test_a_compiled_models_fit_comes_back_and_its_checkpoint_loads_into_the_uncompiled_model(tmp_path):
    """torch.compile's wrapper adds `_orig_mod.` to every key of its state; the Checkpoint's file keeps the plain
    model's keys, and the weights that come back are one process's."""
    local = digits_learner(digits_data(tmp_path / "one", bs=32))
    local.fit(2, 1e-2)
    compiled = digits_learner(digits_data(tmp_path / "nb", bs=16))
    compiled.model = torch.compile(compiled.model, backend="eager")  # the wrapper and its keys, without a compiler
    compiled.to_ddp(nprocs=2)
    compiled.fit(2, 1e-2, callbacks=[Checkpoint(compiled)])
    assert max_diff(params(compiled), params(local)) <= TOL
    saved = torch.load(compiled.path / compiled.model_dir / "checkpoint.pth", weights_only=True)["model"]
    plain = digits_learner(digits_data(tmp_path / "plain", bs=32))
    plain.model.load_state_dict(saved)
    assert max_diff(params(plain), params(compiled)) == 0
