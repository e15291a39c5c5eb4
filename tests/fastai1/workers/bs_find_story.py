"""bs_find's story on fastai v1: a trained learner whose training step runs out of memory above a per-rank ceiling
(a forward pre-hook raising torch.OutOfMemoryError), bs_find, what it left, then a fit; beside the same fits without
bs_find. Played in one process and in notebook mode by tests/fastai1/test_bs_find.py, on 2 ranks by
bs_find_worker.py."""
import contextlib
import io

import torch
from fastai.basic_train import Learner
from torch import nn

import ddipp
from scenario import digits_data

CEILINGS = {0: 300, 1: 200}  # the most items of a training step's batch each rank holds


class Ceiling:
    """A forward pre-hook: torch.OutOfMemoryError when a training batch passes this rank's entry of `ceilings`."""

    def __init__(self, ceilings: dict):
        self.ceilings = ceilings

    def __call__(self, module: nn.Module, args: tuple) -> None:
        limit = self.ceilings[ddipp.rank()]
        if module.training and args[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"the test's ceiling: {args[0].shape[0]} items, {limit} at most")


def ceiling_learner(path, ceilings: dict = CEILINGS) -> Learner:
    """Digits on an MLP with BatchNorm and dropout (buffers and random draws), batch 16, the ceiling's hook on it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    model.register_forward_pre_hook(Ceiling(ceilings))
    return Learner(digits_data(path, 16, shuffle=True), model, loss_func=nn.CrossEntropyLoss())


def held(learn: Learner) -> list:
    """The learner's weights and buffers and its optimizer's state."""
    return ([t.detach().clone() for t in learn.model.state_dict().values()]
            + [t.clone() for s in learn.opt.opt.state_dict()["state"].values() for t in s.values()])


def tensors(learn: Learner) -> list:
    """held(learn), the optimizer's lr and weight decay, the parameters' gradients and torch's generator."""
    groups = learn.opt.opt.param_groups
    return (held(learn) + [torch.tensor([g[k] for k in ("lr", "weight_decay") for g in groups])]
            + [p.grad.clone() for p in learn.model.parameters() if p.grad is not None] + [torch.get_rng_state()])


def learner_facts(learn: Learner) -> tuple:
    """What bs_find must leave as it was, beside the tensors: the learner's attributes (the same objects), its loaders,
    the optimizer wrapper's hyper-parameters and the modules' modes."""
    return (dict(vars(learn)), (learn.data.train_dl, learn.data.valid_dl), dict(vars(learn.opt)),
            [m.training for m in learn.model.modules()])


def same_facts(a: tuple, b: tuple) -> bool:
    attrs_a, attrs_b = a[0], b[0]
    return (attrs_a.keys() == attrs_b.keys() and all(attrs_a[k] is attrs_b[k] for k in attrs_a)
            and all(x is y for x, y in zip(a[1], b[1])) and a[2] == b[2] and a[3] == b[3])


def bs_find_story(make, path) -> dict:
    """A learner from `make(learner)` fits, finds its batch size, fits again; the same two fits
    without bs_find: the size found, its report, whether the learner stayed as it was, both fits' tensors. Then a new
    learner's bs_find: it has no optimizer after it, as before."""
    learn = make(ceiling_learner(path / "found"))
    learn.fit(1, 1e-2)
    before, facts = tensors(learn), learner_facts(learn)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        found = learn.bs_find()
    res = dict(found=found, said=said.getvalue(), kept=same_facts(facts, learner_facts(learn)), before=before,
               after=tensors(learn))
    learn.fit(1, 1e-2)
    res["fit"] = tensors(learn)
    learn = make(ceiling_learner(path / "plain"))
    learn.fit(1, 1e-2)
    learn.fit(1, 1e-2)
    res["plain_fit"] = tensors(learn)
    learn = make(ceiling_learner(path / "fresh"))
    learn.bs_find(max_bs=8)  # no trial out of memory: each takes a garbage collection
    res["fresh_has_opt"] = hasattr(learn, "opt") or hasattr(learn, "recorder")
    return res
