"""fastai v2 on a GPU: to_fp16 under ddipp on one NCCL rank trains as one plain GPU process does (skips without
CUDA)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="to_fp16 and NCCL need a GPU")
def test_to_fp16_on_a_launched_gpu_rank_trains_as_one_gpu_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddipp.launch", "--gpus", "0", str(WORKERS / "fp16_worker.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    launched = json.loads((tmp_path / "rank0.json").read_text())
    from fp16_worker import fp16_fit
    one = fp16_fit(tmp_path / "one")
    assert launched["mixed"] and launched["cuda"] and one["mixed"]
    accuracy = launched["values"][-1]  # train loss, valid loss, accuracy
    assert abs(accuracy - one["values"][-1]) <= 0.05 and accuracy >= 0.8, (launched, one)  # 5 of 101 digits
