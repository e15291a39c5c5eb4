"""Train a small CNN on scikit-learn's digits with fastai v2 + ddipp; prints the validation accuracy.

    python -m ddipp.launch --nproc 2 examples/scripts/train_digits_v2.py   # 2 CPU processes (gloo)
    python -m ddipp.launch --gpus all examples/scripts/train_digits_v2.py  # one process per GPU
    python examples/scripts/train_digits_v2.py                             # the same script, one process
"""
import sys
from pathlib import Path

import torch
from torch import nn

import ddipp
from fastai.vision.all import (ConvLayer, Flatten, ImageDataLoaders, Learner, Normalize, accuracy,
                               imagenet_stats)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits import digits_folder  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
path = digits_folder(Path(__file__).resolve().parents[1] / "data" / "digits")
bs = 64 // ddipp.world_size()  # per-rank batch: the global batch stays 64, whatever the number of ranks
dls = ImageDataLoaders.from_folder(path, train="train", valid="valid", bs=bs, num_workers=0,
                                   batch_tfms=Normalize.from_stats(*imagenet_stats))
model = nn.Sequential(ConvLayer(3, 16, stride=2), ConvLayer(16, 32, stride=2), ConvLayer(32, 64, stride=2),
                      nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(64, 10))
learn = Learner(dls, model, metrics=accuracy).to_ddp()
learn.fit_one_cycle(8, 1e-2)
loss, acc = learn.validate()
if ddipp.is_rank0():
    print(f"validation accuracy {float(acc):.4f} (loss {float(loss):.4f}) on {len(dls.valid_ds)} digits, "
          f"{ddipp.world_size()} process(es)")
