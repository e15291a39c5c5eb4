"""The fastai v2 training story, run by the tests in one process (the reference, batch 32) and by fit_worker.py on 2
launched ranks (batch 16 each): what each step left behind, as plain numbers and tensors."""
import pandas as pd
import torch
from fastai.callback.core import Callback
from fastai.callback.schedule import fit_flat_cos, fit_one_cycle, lr_find  # noqa: F401 (add the Learner methods)
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner, load_learner
from fastai.metrics import F1Score, accuracy
from fastai.optimizer import SGD
from fastai.tabular.all import Normalize, TabularDataLoaders, tabular_learner
from fastai.torch_core import params as group_params
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

from compare import max_diff
from stories import batch_max_prob

N_TRAIN = 645  # digits that train, after the 101 that validate: 20 steps of 32 an epoch (5 left); odd, so 2 ranks
# drop the last position of each epoch's order


def _digits():
    digits = load_digits()
    return torch.tensor(digits.data / 16, dtype=torch.float32), torch.tensor(digits.target)


class ReversedDL(DataLoader):
    """A loader with an order of its own: the items backwards."""

    def get_idxs(self):
        return list(reversed(super().get_idxs()))


def digits_dls(bs, val_bs=64, n_valid=101, n_train=N_TRAIN, shuffle=False, dl_type=DataLoader,
               drop_last=True) -> DataLoaders:
    """scikit-learn's digits as 64 features; the first `n_valid` (odd by default) validate, the next `n_train` train,
    in batches of `bs`."""
    x, y = _digits()
    end = n_valid + n_train
    train = dl_type(TensorDataset(x[n_valid:end], y[n_valid:end]), bs=bs, shuffle=shuffle, drop_last=drop_last)
    valid = DataLoader(TensorDataset(x[:n_valid], y[:n_valid]), bs=val_bs)
    return DataLoaders(train, valid, device="cpu")


def two_groups(model):
    return [group_params(model[0]), group_params(model[2])]


def digits_learner(dls, path, metrics=None) -> Learner:
    """An MLP with no dropout or batch norm, in two layer groups, always with the same initial weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    metrics = [accuracy, F1Score(average="macro"), batch_max_prob] if metrics is None else metrics
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=metrics, splitter=two_groups, path=path)


def params(learn) -> list:
    return [p.detach().clone() for p in learn.model.parameters()]


def history(learn) -> dict:
    """The recorder's numbers as plain floats: per epoch [train_loss, valid_loss, *metrics], per step the smoothed
    loss and the lr."""
    rec = learn.recorder
    return dict(values=[[float(v) for v in row] for row in rec.values], losses=[float(v) for v in rec.losses],
                lrs=[float(v) for v in rec.lrs])


class StepLosses(Callback):
    """Records `learn.loss` after each training step, as other callbacks (TerminateOnNaN) read it."""
    order = 55  # after Recorder

    def before_fit(self):
        self.losses = []

    def after_batch(self):
        if self.training:
            self.losses.append(float(self.learn.loss))


def story(learn) -> dict:
    """fit_one_cycle, freeze + fit, unfreeze + fit_flat_cos, fine_tune: the history and parameters after each, whether
    the plain model and the original loaders are back; validate() and get_preds() between fits."""
    res, loaders = {}, (learn.dls.train, learn.dls.valid)
    steps = StepLosses()
    learn.fit_one_cycle(1, 1e-2, cbs=steps)
    res["fit"], res["params_fit"], res["step_losses"] = history(learn), params(learn), steps.losses
    res["restored"] = type(learn.model) is nn.Sequential and (learn.dls.train, learn.dls.valid) == loaders
    res["validate"] = [float(v) for v in learn.validate()]
    res["preds"] = learn.get_preds()[0]
    learn.freeze()
    learn.fit(1, 1e-2)
    res["fit_frozen"], res["params_frozen"] = history(learn), params(learn)
    learn.unfreeze()
    learn.fit_flat_cos(1, 1e-3)
    res["fit_unfrozen"], res["params_unfrozen"] = history(learn), params(learn)
    learn.fine_tune(1, 1e-3)
    res["fine_tune"], res["params_fine_tune"] = history(learn), params(learn)
    return res


def wide_digits_learner(dls, path) -> Learner:
    """digits_learner with 512 hidden units (160 KB of weights, twice that of Adam's moments)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, splitter=two_groups, path=path)


def changes_between_fits(learn, sent=lambda: None) -> dict:
    """A fit after each change a notebook makes between fits (none; a weight edited by hand; saved weights and
    optimizer loaded; freeze; a new optimizer): the parameters after each, and what `sent()` says after each."""
    res = dict(params=[], sent=[])

    def fit():
        learn.fit(1, 1e-2)
        res["params"].append(params(learn))
        res["sent"].append(sent())
    fit()
    learn.save("saved")
    fit()  # unchanged
    learn.model[0].weight.data[3] = 0.5  # by hand, through .data (which autograd does not track)
    fit()
    learn.load("saved")
    fit()
    learn.freeze()
    fit()
    learn.unfreeze()
    learn.opt_func = SGD
    learn.create_opt()
    fit()
    return res


def sweep(learn, num_it=20, sweep_bs=None) -> dict:
    """A fit (the optimizer gets a state), then lr_find (with batch `sweep_bs`, if given): its suggestion, what it
    recorded, whether it left the weights and the optimizer's state as they were, and the hyper-parameters it left."""
    learn.fit(1, 1e-2)
    if sweep_bs is not None:
        learn.dls = digits_dls(bs=sweep_bs)
    before, moments = params(learn), _moments(learn)
    suggestion = learn.lr_find(num_it=num_it, show_plot=False)
    kept = max_diff(before, params(learn)) == 0 and max_diff(moments, _moments(learn)) == 0
    return dict(valley=float(suggestion.valley), losses=[float(v) for v in learn.recorder.losses],
                lrs=[float(v) for v in learn.recorder.lrs], kept=kept, hypers=[dict(h) for h in learn.opt.hypers])


def _moments(learn) -> list:
    return [t.clone() for p, *_ in learn.opt.all_params() for t in learn.opt.state[p].values()
            if isinstance(t, torch.Tensor)]


class RaiseAt(Callback):
    """Fails the fit at its 4th training batch."""

    def after_batch(self):
        if self.training and self.iter == 3:
            raise RuntimeError("failing on purpose")


def failed_fit(learn) -> dict:
    """A fit that raises: are the plain model and the original loaders back, and does the next fit work?"""
    loaders = (learn.dls.train, learn.dls.valid)
    raised = None
    try:
        learn.fit(1, 1e-2, cbs=RaiseAt())
    except RuntimeError as e:
        raised = str(e)
    restored = type(learn.model) is nn.Sequential and (learn.dls.train, learn.dls.valid) == loaders
    learn.fit(1, 1e-2)
    return dict(raised=raised, restored=restored, params=params(learn), fit=history(learn))


class EpochOrders(Callback):
    """Records, at each epoch's start, the training items this process reads (after ddipp sharded them)."""
    order = 0  # after DistributedCallback

    def before_fit(self):
        self.orders = []

    def before_train(self):
        self.orders.append([int(i) for i in self.learn.dl.get_idxs()])  # the order the loader reads this epoch


def orders(learn, epochs=3) -> list:
    recorder = EpochOrders()
    learn.fit(epochs, 1e-2, cbs=recorder)
    return recorder.orders


def tabular_digits_learner(path, bs):
    """A tabular learner on the digits features (fastai's TabDataLoader, BatchNorm layers; it can be exported): 644
    train in order, with no drop_last (the ranks' last batches have 2 items each, one process's has 4)."""
    x, y = _digits()
    df = pd.DataFrame(x.numpy(), columns=[f"p{i}" for i in range(64)]).assign(label=y.numpy())[:101 + 644]
    dls = TabularDataLoaders.from_df(df, path=path, cont_names=list(df.columns[:64]), y_names="label",
                                     procs=[Normalize], valid_idx=list(range(101)), bs=bs, shuffle=False,
                                     num_workers=0, device="cpu")
    torch.manual_seed(0)
    return tabular_learner(dls, layers=[32], metrics=accuracy)


def saved_and_exported(learn) -> dict:
    """Fit, save, spoil, load; export, load_learner: the weights (and BatchNorm statistics) at each point, what the
    loaded learner holds, the files left."""
    learn.fit(1, 1e-2)
    trained = state(learn)
    learn.save("final")
    with torch.no_grad():
        for p in learn.model.parameters():
            p.add_(1.0)
    learn.load("final")
    loaded = state(learn)
    learn.export("final.pkl")
    exported = load_learner(learn.path / "final.pkl")
    return dict(trained=trained, loaded=loaded, exported=state(exported), fit=history(learn),
                exported_callbacks=sorted(type(cb).__name__ for cb in exported.cbs),
                files=sorted(str(p.relative_to(learn.path)) for p in learn.path.rglob("*") if p.is_file()))


def state(learn) -> list:
    """The model's parameters and buffers (BatchNorm's running statistics)."""
    return [t.detach().clone().float() for t in learn.model.state_dict().values()]


def refused(make) -> str:
    """The error a fit of `make()`'s learner raises, as 'Type: message'."""
    try:
        make().fit(1, 1e-2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def torch_batches_learner(path) -> Learner:
    """A learner whose training loader is a PyTorch DataLoader of a batch_sampler of its own (fastai v2 trains with it
    in one process; ddipp shards a sampler in batches of batch_size)."""
    x, y = _digits()
    ds = TensorDataset(x[101:200], y[101:200])
    batches = [list(range(i, i + 16)) for i in range(0, 96, 16)]
    return digits_learner(DataLoaders(TorchDataLoader(ds, batch_sampler=batches), TorchDataLoader(ds, 16)), path)


def tiny_valid(learn) -> list:
    learn.fit(1, 1e-2)
    return history(learn)["values"]

