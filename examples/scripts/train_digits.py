"""Train a small CNN on scikit-learn's digits with fastai v1 + ddipp; prints the validation accuracy.

    python -m ddipp.launch --nproc 2 examples/scripts/train_digits.py   # 2 CPU processes (gloo)
    python -m ddipp.launch --gpus all examples/scripts/train_digits.py  # one process per GPU
    python examples/scripts/train_digits.py                             # the same script, one process
"""
import sys
from pathlib import Path

import torch
from torch import nn

import ddipp  # before fastai: ddipp keeps fastai 1.0.61's import quiet on this stack
from fastai.vision import ImageDataBunch, Learner, PoolFlatten, accuracy, conv_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits import digits_folder  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
path = digits_folder(Path(__file__).resolve().parents[1] / "data" / "digits")
bs = 64 // ddipp.world_size()  # per-rank batch: the global batch stays 64, whatever the number of ranks
data = ImageDataBunch.from_folder(path, size=32, bs=bs, num_workers=0).normalize()
model = nn.Sequential(conv_layer(3, 16, stride=2), conv_layer(16, 32, stride=2), conv_layer(32, 64, stride=2),
                      PoolFlatten(), nn.Linear(64, 10))
learn = Learner(data, model, metrics=accuracy).to_ddp()
learn.fit_one_cycle(8, 1e-2)
loss, acc = learn.validate()
if ddipp.is_rank0():
    print(f"validation accuracy {float(acc):.4f} (loss {float(loss):.4f}) on {len(data.valid_ds)} digits, "
          f"{ddipp.world_size()} process(es)")
