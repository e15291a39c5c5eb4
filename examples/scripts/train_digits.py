"""Train a small CNN on scikit-learn's digits with fastai v1; prints the validation accuracy.

    python examples/scripts/train_digits.py
"""
import sys
from pathlib import Path

import torch
from fastai.vision import ImageDataBunch, Learner, accuracy, simple_cnn

import ddipp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digits import digits_folder  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
path = digits_folder(Path(__file__).resolve().parents[1] / "data" / "digits")
data = ImageDataBunch.from_folder(path, size=32, bs=64, num_workers=0).normalize()
learn = Learner(data, simple_cnn((3, 16, 32, 64, 10)), metrics=accuracy)
learn.fit_one_cycle(8, 1e-2)
loss, acc = learn.validate()
if ddipp.is_rank0():
    print(f"validation accuracy {float(acc):.4f} (loss {float(loss):.4f}) on {len(data.valid_ds)} digits")
