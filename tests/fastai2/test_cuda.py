"""fastai v2 on a GPU: to_fp16 under ddipp on 2 ranks sharing it over gloo trains as one plain GPU process does
(skips without CUDA; a group of one rank trains as plain fastai, so it would not run DDP)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fastai v2's to_fp16 needs a GPU")
def test_to_fp16_on_two_ranks_sharing_a_gpu_trains_as_one_gpu_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddipp.launch", "--nproc", "2", str(WORKERS / "fp16_worker.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    launched = json.loads((tmp_path / "rank0.json").read_text())
    from fp16_worker import fp16_fit
    one = fp16_fit(tmp_path / "one")
    assert launched["mixed"] and launched["cuda"] and one["mixed"] and launched["world_size"] == 2
    accuracy = launched["values"][-1]  # train loss, valid loss, accuracy
    assert abs(accuracy - one["values"][-1]) <= 0.05 and accuracy >= 0.8, (launched, one)  # 5 of 101 digits
