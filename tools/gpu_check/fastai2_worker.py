"""fastai v2 run of tools/gpu_check.py on cuda:0: GCCallback's after_fit gives the CUDA cache back; saves what it saw
to OUT/rank0.pt.

    python tools/gpu_check/fastai2_worker.py gc OUT
"""
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).parent))

import ddipp  # noqa: E402 (before fastai, as in a user's script)
from fastai.callback.core import Callback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from models import random_images, wide_cnn  # noqa: E402


class ReservedAtFitEnd(Callback):
    """torch.cuda.memory_reserved() at the end of the fit, just before GCCallback's after_fit."""
    order = 99  # GCCallback's is 100

    def after_fit(self) -> None:
        self.reserved = torch.cuda.memory_reserved()


def gc(out: Path) -> dict:
    """A fit of wide activations with GCCallback: reserved CUDA memory before its after_fit and after the fit."""
    x, y = random_images(1280, 64)
    dls = DataLoaders(DataLoader(TensorDataset(x[256:], y[256:]), bs=256, drop_last=True),
                      DataLoader(TensorDataset(x[:256], y[:256]), bs=64), device=torch.device("cuda", 0))
    probe = ReservedAtFitEnd()
    learn = Learner(dls, wide_cnn(), loss_func=nn.CrossEntropyLoss(), cbs=[probe, ddipp.GCCallback()], path=out)
    learn.fit(1, 1e-3)
    return dict(before=probe.reserved, after=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())


if __name__ == "__main__":
    seen = {"gc": gc}[sys.argv[1]](Path(sys.argv[2]))
    torch.save(seen, Path(sys.argv[2]) / "rank0.pt")
