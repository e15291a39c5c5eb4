"""Launched by tests/fastai2/test_cuda.py as 2 ranks sharing one GPU over gloo (batch 16 each), and run there as one
plain GPU process (batch 32): the digits MLP trained with fastai v2's to_fp16 under ddipp."""
import json
import sys
from pathlib import Path

import torch
from fastai.callback.fp16 import MixedPrecision  # (also adds Learner.to_fp16)
from fastai.metrics import accuracy

import ddipp
from fit_story import digits_dls, digits_learner
from gpu_pair import join_gloo_on_cuda0


def fp16_fit(path, bs=32) -> dict:
    """to_fp16 and fit_one_cycle on this process's GPU: the last recorded numbers, whether it ran mixed precision."""
    dls = digits_dls(bs=bs)
    dls.device = ddipp.device() if ddipp.core.dist.launched() else torch.device("cuda")
    learn = digits_learner(dls, path, metrics=[accuracy]).to_ddp().to_fp16()
    learn.fit_one_cycle(5, 3e-2)  # 0.86 accuracy on the 101 digits in fp32 on a CPU
    return dict(values=[float(v) for v in learn.recorder.values[-1]], cuda=next(learn.model.parameters()).is_cuda,
                mixed=any(isinstance(cb, MixedPrecision) for cb in learn.cbs), world_size=ddipp.world_size())


if __name__ == "__main__":
    join_gloo_on_cuda0()
    result = fp16_fit(Path(sys.argv[1]), bs=32 // ddipp.world_size())
    if ddipp.is_rank0():
        (Path(sys.argv[1]) / "rank0.json").write_text(json.dumps(result))
