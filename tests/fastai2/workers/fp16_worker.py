"""Launched on one GPU rank (NCCL) by tests/fastai2/test_cuda.py, and run there as one plain process: the digits MLP
trained with fastai v2's to_fp16 under ddipp."""
import json
import sys
from pathlib import Path

import torch
from fastai.callback.fp16 import MixedPrecision  # (also adds Learner.to_fp16)
from fastai.metrics import accuracy

import ddipp
from fit_story import digits_dls, digits_learner


def fp16_fit(path) -> dict:
    """to_fp16 and fit_one_cycle on this process's GPU: the last recorded numbers, whether it ran mixed precision."""
    dls = digits_dls(bs=32)
    dls.device = ddipp.device() if ddipp.core.dist.launched() else torch.device("cuda")
    learn = digits_learner(dls, path, metrics=[accuracy]).to_ddp().to_fp16()
    learn.fit_one_cycle(5, 3e-2)  # 0.86 accuracy on the 101 digits in fp32 on a CPU
    return dict(values=[float(v) for v in learn.recorder.values[-1]], cuda=next(learn.model.parameters()).is_cuda,
                mixed=any(isinstance(cb, MixedPrecision) for cb in learn.cbs))


if __name__ == "__main__":
    result = fp16_fit(Path(sys.argv[1]))
    if ddipp.is_rank0():
        (Path(sys.argv[1]) / "rank0.json").write_text(json.dumps(result))
