"""Two or more launched ranks on one GPU: what a one-GPU host can run of DDP on CUDA tensors."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ddipp.core import dist as ddist


def join_gloo_on_cuda0() -> None:
    """Put every local rank on cuda:0 and join the launcher's group over gloo. ddipp.launch cannot ask for this (its
    CUDA ranks take NCCL, one GPU each), so the rank sets ddipp's device list and joins gloo itself."""
    os.environ[ddist.DEVICES_ENV] = ",".join("0" * int(os.environ["LOCAL_WORLD_SIZE"]))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ[ddist.TIMEOUT_ENV])))
