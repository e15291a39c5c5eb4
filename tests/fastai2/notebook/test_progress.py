"""The progress relay and its mirror: every kind of event rank 0's relay sends has a method of that name here."""
import torch
from fastai.callback.progress import ProgressCallback, ShowGraphCallback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from torch import nn
from torch.utils.data import TensorDataset

from ddipp.fastai2.notebook.progress import ProgressMirror, ProgressRelay


def test_every_event_the_relay_sends_is_one_the_mirror_replays(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(96, 4), torch.randint(0, 2, (96,))
    dls = DataLoaders(DataLoader(TensorDataset(x[:64], y[:64]), bs=16), DataLoader(TensorDataset(x[64:], y[64:]), bs=8),
                      device="cpu")
    learn = Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), path=tmp_path, cbs=ShowGraphCallback())
    learn.remove_cb(ProgressCallback)
    events = []
    learn.fit(2, 1e-2, cbs=ProgressRelay(events.append))
    kinds = {kind for kind, *_ in events}
    assert {"master", "epoch", "master_end", "write", "graph", "child", "update", "child_end"} <= kinds
    assert [kind for kind in sorted(kinds) if not callable(getattr(ProgressMirror, kind, None))] == []
    mirror = ProgressMirror()
    for event in events:
        mirror(*event)
    assert mirror.bar.main_bar.total == 2 and mirror.child_bar.total == 4  # the last child: 32 items, 8 a batch
