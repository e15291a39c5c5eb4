"""One training story, run by the tests in one process (the reference) and by fit_worker.py on 2 ranks."""
import torch
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner, LearnerCallback
from fastai.metrics import FBeta, accuracy
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def batch_max_prob(out, targ):
    """A metric that depends on how the set is batched: exact only if every batch is the single-process one."""
    return out.softmax(-1).max()


def digits_data(path, bs, val_bs=64, n_valid=359, shuffle=False) -> DataBunch:
    """scikit-learn's digits as 64 features; the first `n_valid` (an odd number by default) validate."""
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16, dtype=torch.float32), torch.tensor(digits.target)
    train = DataLoader(TensorDataset(x[n_valid:], y[n_valid:]), bs, shuffle=shuffle, drop_last=True)
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
    res["sweep_before"] = sweep(learn)
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


class EpochOrders(LearnerCallback):
    """Records, at each epoch's start, the training items this process will see (after ddipp sharded them)."""
    _order = 0

    def on_train_begin(self, **kwargs):
        self.orders = []

    def on_epoch_begin(self, **kwargs):
        self.orders.append([int(i) for i in self.learn.data.train_dl.dl.batch_sampler.sampler])
