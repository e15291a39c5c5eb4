"""Launched on one GPU by tests/test_cuda.py: a fit under NCCL, and where everything ended up."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ddipp
from scenario import digits_data, digits_learner, history, params

out = Path(sys.argv[1])
learn = digits_learner(digits_data(out, bs=32))
learn.data.device = learn.data.train_dl.device = learn.data.valid_dl.device = ddipp.device()
learn.model.to(ddipp.device())
learn.to_ddp()
learn.fit(2, 1e-2)
torch.save(dict(backend=dist.get_backend(), device=str(ddipp.device()), history=history(learn),
                params=[p.cpu() for p in params(learn)], param_device=str(next(learn.model.parameters()).device)),
           out / f"rank{ddipp.rank()}.pt")
