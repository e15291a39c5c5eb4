"""Launched by tests/fastai1/test_apps.py as 2 ranks sharing one GPU over gloo (batch 16 each), and run there as one
plain GPU process (batch 32): the digits MLP trained with to_fp16 under ddipp."""
import json
import sys
from pathlib import Path

import torch
from fastai.basic_data import DataBunch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import ddipp
from gpu_pair import join_gloo_on_cuda0
from scenario import digits_learner


def fp16_fit(path, bs=32) -> dict:
    """to_fp16 and a fit on the GPU (ddipp's device when launched); whether the model ran in half precision."""
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16, dtype=torch.float32), torch.tensor(digits.target)
    device = ddipp.device() if ddipp.core.dist.launched() else torch.device("cuda")
    data = DataBunch.create(TensorDataset(x[359:], y[359:]), TensorDataset(x[:359], y[:359]), bs=bs, path=path,
                            device=device, num_workers=0)
    learn = digits_learner(data).to_ddp().to_fp16()
    learn.model.to(device)
    learn.fit_one_cycle(5, 1e-2)  # 0.911 accuracy in one process (3 epochs: 0.889)
    return dict(final=[float(v) for v in [learn.recorder.val_losses[-1], *learn.recorder.metrics[-1]]],
                half=next(learn.model.parameters()).dtype == torch.float16, world_size=ddipp.world_size())


if __name__ == "__main__":
    join_gloo_on_cuda0()
    res = fp16_fit(Path(sys.argv[1]), bs=32 // ddipp.world_size())
    if ddipp.is_rank0():
        (Path(sys.argv[1]) / "rank0.json").write_text(json.dumps(res))
