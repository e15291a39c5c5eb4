"""One training story, run by the tests in one process (the reference) and by fit_worker.py on 2 ranks."""
import contextlib
import inspect
import io
import tempfile
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner, LearnerCallback, load_learner
from fastai.callbacks import CSVLogger, EarlyStoppingCallback, ReduceLROnPlateauCallback, SaveModelCallback
from fastai.metrics import FBeta, accuracy
from fastai.tabular import Normalize, TabularList, tabular_learner
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddipp
from stories import batch_max_prob


def digits_data(path, bs, val_bs=64, n_valid=359, shuffle=False, drop_last=True) -> DataBunch:
    """scikit-learn's digits as 64 features; the first `n_valid` (an odd number by default) validate."""
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16, dtype=torch.float32), torch.tensor(digits.target)
    train = DataLoader(TensorDataset(x[n_valid:], y[n_valid:]), bs, shuffle=shuffle, drop_last=drop_last)
    valid = DataLoader(TensorDataset(x[:n_valid], y[:n_valid]), val_bs)
    return DataBunch(train, valid, path=path, device=torch.device("cpu"), no_check=True)


def digits_learner(data) -> Learner:
    """An MLP with no dropout or batch norm, in two layer groups, always with the same initial weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    learn = Learner(data, model, loss_func=nn.CrossEntropyLoss(),
                    metrics=[accuracy, batch_max_prob, FBeta(average="macro")])
    return learn.split([model[2]])


def params(learn):
    return [p.detach().clone() for p in learn.model.parameters()]


def _floats(values):
    return [None if v is None else float(v) for v in values]


def history(learn):
    """The recorder's numbers as plain floats (None where fastai recorded no validation)."""
    rec = learn.recorder
    return dict(losses=_floats(rec.losses), val_losses=_floats(rec.val_losses),
                metrics=[_floats(ms) for ms in rec.metrics], lrs=_floats(rec.lrs))


def sweep(learn, num_it=20):
    """lr_find, then what it recorded and whether it left the weights as they were."""
    before = params(learn)
    learn.lr_find(num_it=num_it)
    kept = all(torch.equal(a, b) for a, b in zip(before, params(learn)))
    return dict(history(learn), kept_weights=kept)


def story(learn):
    """lr_find, fit, validate, get_preds, freeze/fit, unfreeze/fit, lr_find, save/load: what each left behind."""
    res, loaders = {}, (learn.data.train_dl, learn.data.valid_dl)
    res["validate_before"] = [float(v) for v in learn.validate(metrics=[accuracy, batch_max_prob])]
    res["preds_before"] = learn.get_preds()[0]
    res["sweep_before"] = sweep(learn)
    res["plot"] = learn.recorder.plot(return_fig=True) is not None
    learn.fit_one_cycle(2, 1e-2)
    res["fit"], res["params_fit"] = history(learn), params(learn)
    res["restored"] = (type(learn.model) is nn.Sequential
                       and (learn.data.train_dl, learn.data.valid_dl) == loaders)
    res["validate"] = [float(v) for v in learn.validate(metrics=[accuracy, batch_max_prob])]
    res["preds"] = learn.get_preds()[0]
    learn.freeze()
    learn.fit(1, 1e-2)
    res["params_frozen"], res["fit_frozen"] = params(learn), history(learn)
    learn.unfreeze()
    learn.fit_one_cycle(1, 1e-3)
    res["params_unfrozen"], res["fit_unfrozen"] = params(learn), history(learn)
    res["sweep_after"] = sweep(learn, num_it=10)
    learn.save("final")
    with torch.no_grad():
        for p in learn.model.parameters():
            p.add_(1.0)
    learn.load("final")
    res["params_loaded"] = params(learn)
    return res


def tabular_digits_learner(path):
    """A tabular learner on the digits features (fastai data blocks, so it can be exported)."""
    digits = load_digits()
    df = pd.DataFrame(digits.data, columns=[f"p{i}" for i in range(64)]).assign(label=digits.target)
    data = (TabularList.from_df(df, path=path, cont_names=list(df.columns[:64]), procs=[Normalize])
            .split_by_idx(list(range(359))).label_from_df("label").databunch(bs=16, num_workers=0))
    learn = tabular_learner(data, layers=[32], metrics=accuracy)
    return learn


def exported(learn):
    """Fit, export, load_learner: the trained and the loaded weights; the bytes of save and export to a buffer; what
    `validate`, `save` and `export` are (name, docstring, signature)."""
    learn.fit(1, 1e-2)
    learn.export("final.pkl")
    ddipp.barrier()  # fastai's export writes on rank 0 alone and waits for no one: rank 1 loads the file below
    saved, exported_ = io.BytesIO(), io.BytesIO()
    learn.save(saved)
    learn.export(exported_)
    methods = {name: method_facts(getattr(learn, name)) for name in ("validate", "save", "export")}
    return dict(trained=params(learn), loaded=params(load_learner(learn.path, "final.pkl")), saved=as_tensor(saved),
                exported=as_tensor(exported_), methods=methods)


def as_tensor(buffer: io.BytesIO) -> torch.Tensor:
    """The bytes of `buffer` as a uint8 tensor (a weights-only load takes it)."""
    return torch.tensor(bytearray(buffer.getvalue()), dtype=torch.uint8)


def method_facts(method) -> dict:
    """Whether `method` is a bound method, and its name, docstring and signature."""
    return dict(method=inspect.ismethod(method), name=getattr(method, "__name__", None), doc=method.__doc__,
                signature=str(inspect.signature(method)))


class RaiseAt(LearnerCallback):
    """Fails the fit at its 4th training batch."""

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 3:
            raise RuntimeError("failing on purpose")


def failed_fit(learn):
    """A fit that raises: is the plain model and the original loaders back, and does the next fit work?"""
    loaders = (learn.data.train_dl, learn.data.valid_dl)
    learn.callback_fns.append(RaiseAt)
    try:
        learn.fit(1, 1e-2)
    except RuntimeError as e:
        raised = str(e)
    restored = type(learn.model) is nn.Sequential and (learn.data.train_dl, learn.data.valid_dl) == loaders
    learn.callback_fns.pop()
    learn.fit(1, 1e-2)
    return dict(raised=raised, restored=restored, params=params(learn))


def decisions(learn):
    """Callbacks that decide from validation numbers: keep the best, stop early, lower the lr on a plateau."""
    learn.callback_fns += [partial(SaveModelCallback, monitor="accuracy", name="best"),
                           partial(EarlyStoppingCallback, monitor="valid_loss", min_delta=0.02, patience=1),
                           partial(ReduceLROnPlateauCallback, monitor="valid_loss", min_delta=0.02, patience=0)]
    learn.fit(8, 2e-2)
    return dict(history(learn), params=params(learn))


class EpochOrders(LearnerCallback):
    """Records, at each epoch's start, the training items this process will see (after ddipp sharded them)."""
    _order = 0

    def on_train_begin(self, **kwargs):
        self.orders = []

    def on_epoch_begin(self, **kwargs):
        self.orders.append([int(i) for i in self.learn.data.train_dl.dl.batch_sampler.sampler])


def between_fits(learn, bs):
    """What a notebook changes between fits: new data, new metrics (one a lambda), a callback class made here
    (it travels by value), a reload of saved weights, freeze; and the optimizer state the fits leave."""
    class BatchCounter(LearnerCallback):
        def on_train_begin(self, **kwargs):
            self.count = 0

        def on_batch_end(self, train, **kwargs):
            self.count += int(train)

    learn.fit(1, 1e-2)
    learn.save("first")
    learn.data = digits_data(learn.path, bs=bs, n_valid=101)
    learn.metrics = [accuracy, FBeta(average="macro"), lambda out, targ: (out.argmax(-1) == targ).float().mean()]
    learn.callback_fns.append(BatchCounter)
    learn.fit(1, 1e-2)
    learn.load("first")
    learn.freeze()
    learn.fit(2, 1e-2)
    opt_state = [learn.opt.opt.state[p] for p in learn.model.parameters() if p in learn.opt.opt.state]
    return dict(history(learn), params=params(learn), batches=learn.batch_counter.count,
                opt_state=[s["exp_avg"] for s in opt_state])


def opt_state(learn):
    """The optimizer's hyper-parameters as fastai reports them, and as its parameter groups hold them."""
    opt = learn.opt
    return dict(lr=opt.lr, mom=opt.mom, beta=opt.beta, wd=opt.wd,
                groups=[[pg["lr"], *pg["betas"], pg["weight_decay"]] for pg in opt.opt.param_groups])


def swept_state(learn, num_it=20):
    """sweep(), then the optimizer's hyper-parameters it left."""
    return dict(sweep(learn, num_it), opt=opt_state(learn))


def evaluation(learn):
    """validate() with the learner's metrics and with plain ones, get_preds() with losses: what a rank alone gets."""
    preds, targets, losses = learn.get_preds(with_loss=True)
    return dict(validate=[float(v) for v in learn.validate()],
                validate_plain=[float(v) for v in learn.validate(metrics=[accuracy, batch_max_prob])],
                preds=preds, losses=losses)


class TempEntries(LearnerCallback):
    """Records, at each epoch's end, the ddipp-csv-* entries of the temp folder (while the fit runs)."""

    def on_train_begin(self, **kwargs):
        self.seen = []

    def on_epoch_end(self, **kwargs):
        self.seen += csv_scratch_entries()


def csv_scratch_entries():
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob("ddipp-csv-*"))


class RaiseAtTrainBegin(LearnerCallback):
    """Fails the fit in on_train_begin, after ddipp's callbacks and CSVLogger began it (so on_train_end never runs)."""
    _order = 5

    def on_train_begin(self, **kwargs):
        raise RuntimeError("failing on purpose at train begin")


def csv_fits(make_learner):
    """Fits with and without CSVLogger, one that fails mid-way, one that fails in on_train_begin: the ddipp-csv-*
    entries of the temp folder during and after each. `make_learner()` gives a fresh learner."""
    res = {}
    learn = make_learner()
    learn.callback_fns += [partial(CSVLogger, filename="history"), TempEntries]
    learn.fit(2, 1e-2)
    res["during_csv_fit"] = learn.temp_entries.seen
    learn.callback_fns[-2:] = [partial(CSVLogger, filename="history_failed"), RaiseAt]
    with contextlib.suppress(RuntimeError):
        learn.fit(1, 1e-2)
    res["after_failed_fit"] = csv_scratch_entries()
    learn = make_learner()
    learn.callback_fns.append(TempEntries)
    learn.fit(1, 1e-2)
    res["during_plain_fit"] = learn.temp_entries.seen
    learn = make_learner()
    learn.callback_fns += [partial(CSVLogger, filename="history_begin"), RaiseAtTrainBegin]
    with contextlib.suppress(RuntimeError):
        learn.fit(1, 1e-2)
    res["after_failed_begin"] = csv_scratch_entries()
    return res
