"""scikit-learn's bundled digits as an image folder fastai reads like any course-v3 dataset (no download)."""
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def digits_folder(path, size: int = 32) -> Path:
    """Write the 1797 digits as `size`x`size` RGB PNGs under `path`/{train,valid}/<digit>/ (every 5th is valid).

    Written to a temporary folder and renamed, so concurrent callers never see a half-written set."""
    path = Path(path)
    if path.is_dir():
        return path
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    digits = load_digits()
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        folder = tmp / ("valid" if i % 5 == 0 else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (img * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels).resize((size, size), Image.BILINEAR).convert("RGB").save(folder / f"{i}.png")
    try:
        tmp.rename(path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp)
    return path
