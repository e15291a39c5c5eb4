"""Shared fixtures: tiny data sets made on the spot (no downloads) and a one-thread torch."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def digits_path(tmp_path_factory):
    from digits import digits_folder
    return digits_folder(tmp_path_factory.mktemp("data") / "digits")
