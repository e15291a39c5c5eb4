"""fastai v2 runs of tools/gpu_check.py on cuda:0, as one plain process or under `python -m ddipp.launch`; every rank
saves what it saw to OUT/rank{r}.pt.

    python tools/gpu_check/fastai2_worker.py MODE OUT   # MODE: gc, shard, shard-gloo, memory-ddp, memory-shard,
                                                        # fsdp-bf16 (plain torch FSDP2, no fastai), recompute, bs-find
"""
import contextlib
import io
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2] / "tests" / "core" / "workers")]

import ddipp  # noqa: E402 (before fastai, as in a user's script)
from ddipp.core import dist as ddist  # noqa: E402
from fastai.callback.core import Callback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.optimizer import SGD  # noqa: E402
from gpu_pair import join_gloo_on_cuda0  # noqa: E402
from models import digits_images, digits_mlp, random_images, small_cnn, wide_cnn, wide_mlp  # noqa: E402

N_VALID_DIGITS = 359  # the first digits validate, the rest train: 1438, 44 steps of 32 an epoch


class ReservedAtFitEnd(Callback):
    """torch.cuda.memory_reserved() at the end of the fit, just before GCCallback's after_fit."""
    order = 99  # GCCallback's is 100

    def after_fit(self) -> None:
        self.reserved = torch.cuda.memory_reserved()


def gc(out: Path) -> dict:
    """A fit of wide activations with GCCallback: reserved CUDA memory before its after_fit and after the fit."""
    x, y = random_images(1280, 64)
    dls = DataLoaders(DataLoader(TensorDataset(x[256:], y[256:]), bs=256, drop_last=True),
                      DataLoader(TensorDataset(x[:256], y[:256]), bs=64), device=torch.device("cuda", 0))
    probe = ReservedAtFitEnd()
    learn = Learner(dls, wide_cnn(), loss_func=nn.CrossEntropyLoss(), cbs=[probe, ddipp.GCCallback()], path=out)
    learn.fit(1, 1e-3)
    return dict(before=probe.reserved, after=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())


def shard(out: Path) -> dict:
    """The digits MLP with to_ddp(shard=True) (a no-op in a plain process), global batch 32, fastai's SGD with
    momentum (its state sharded too): the weights after 2 epochs, as plain tensors, and what to_ddp printed."""
    x, y = digits_images()
    x, n = x.view(len(x), -1), N_VALID_DIGITS
    bs = 32 // ddipp.world_size()
    dls = DataLoaders(DataLoader(TensorDataset(x[n:], y[n:]), bs=bs, drop_last=True),
                      DataLoader(TensorDataset(x[:n], y[:n]), bs=64), device=ddist.device())
    # SGD, not Adam: Adam turns the float noise of another batch split (16 + 16 against 32) into whole steps
    learn = Learner(dls, digits_mlp(), loss_func=nn.CrossEntropyLoss(), opt_func=partial(SGD, mom=0.9), path=out)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        learn.to_ddp(shard=True)
    learn.fit(2, 0.1)
    params = list(learn.model.parameters())
    return dict(params=[p.detach().cpu() for p in params], plain=all(type(p) is nn.Parameter for p in params),
                device=str(params[0].device), said=said.getvalue(), world_size=ddipp.world_size(),
                backend=dist.get_backend() if dist.is_initialized() else "none")


def shard_gloo(out: Path) -> dict:
    """`shard` on ranks sharing cuda:0 over gloo."""
    join_gloo_on_cuda0()
    return shard(out)


def held_bytes(learn: Learner) -> int:
    """The bytes of parameters, gradients and optimizer state this rank holds (of a sharded tensor, its own part)."""
    opt = learn.opt
    tensors = [*learn.model.parameters(), *(p.grad for p in learn.model.parameters()),
               *(v for p, *_ in opt.all_params() for v in opt.state[p].values())]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local if t.dim() > 0)


class TrainingPeak(Callback):
    """torch.cuda.max_memory_allocated() over the fit's training phases (the model as the fit holds it: in DDP, or
    sharded), and held_bytes after the last step."""
    order = 60  # after DistributedCallback (-5) wrapped the model

    def before_fit(self) -> None:
        self.peak = 0

    def before_train(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def after_train(self) -> None:
        torch.cuda.synchronize()
        self.peak, self.held = max(self.peak, torch.cuda.max_memory_allocated()), held_bytes(self.learn)


def memory(out: Path, shard: bool) -> dict:
    """The wide MLP (33.6 M parameters) trained with fastai's Adam on 2 ranks sharing cuda:0 over gloo, batch 32
    each, in DDP or with shard=True: this rank's training peak and what it held."""
    join_gloo_on_cuda0()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(320, 2048, generator=generator), torch.randint(0, 10, (320,), generator=generator)
    dls = DataLoaders(DataLoader(TensorDataset(x[64:], y[64:]), bs=32, drop_last=True),
                      DataLoader(TensorDataset(x[:64], y[:64]), bs=64), device=ddist.device())
    peak = TrainingPeak()
    learn = Learner(dls, wide_mlp(), loss_func=nn.CrossEntropyLoss(), cbs=peak, path=out).to_ddp(shard=shard)
    learn.fit(1, 1e-4)
    return dict(peak=peak.peak, held=peak.held, world_size=ddipp.world_size(), device=str(ddist.device()),
                n_params=sum(p.numel() for p in learn.model.parameters()))


STEPS = 20  # SGD steps of the bf16 check


def fsdp_bf16(out: Path) -> dict:
    """Plain torch FSDP2 (no fastai) on ranks sharing cuda:0 over gloo: the digits MLP, each Linear and the root
    fully_shard-ed, STEPS plain SGD steps on a global batch of 64 (32 each), once in float32 and once with
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); the weights before and after each, gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    join_gloo_on_cuda0()
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), ddist.device()
    x, y = digits_images()
    x, y = x.view(len(x), -1)[N_VALID_DIGITS:].to(device), y[N_VALID_DIGITS:].to(device)
    mesh, per_rank = init_device_mesh(device.type, (world_size,)), 64 // world_size
    runs = {}
    for name, policy in (("fp32", MixedPrecisionPolicy()),
                         ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        model = digits_mlp().to(device)
        start = [p.detach().cpu() for p in model.parameters()]
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            batch = slice(64 * step + rank * per_rank, 64 * step + (rank + 1) * per_rank)
            logits = model(x[batch])
            F.cross_entropy(logits.float(), y[batch]).backward()
            opt.step()
            opt.zero_grad()
        runs[name] = dict(start=start, params=[p.detach().full_tensor().cpu() for p in model.parameters()],
                          computed=str(logits.dtype), stored=str(next(model.parameters()).dtype))
    return dict(runs=runs, world_size=world_size, device=str(device), backend=dist.get_backend())


def recompute(out: Path) -> dict:
    """small_cnn on 3x64x64 images, batch 128, fastai's SGD with momentum, plain and with ddipp.Recompute of its
    three conv-BatchNorm blocks, cuDNN deterministic: each fit's training peak and its parameters and buffers after."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    x, y = random_images(640, 64)
    fits = {}
    for name in ("plain", "Recompute"):
        dls = DataLoaders(DataLoader(TensorDataset(x[128:], y[128:]), bs=128, drop_last=True),
                          DataLoader(TensorDataset(x[:128], y[:128]), bs=128), device=ddist.device())
        model, peak = small_cnn(), TrainingPeak()
        cbs = [peak] + ([ddipp.Recompute(modules=list(model)[:3])] if name == "Recompute" else [])
        learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=partial(SGD, mom=0.9), cbs=cbs, path=out)
        learn.fit(1, 0.1)
        fits[name] = dict(peak=peak.peak, state={k: v.detach().cpu() for k, v in learn.model.state_dict().items()},
                          params=[k for k, _ in learn.model.named_parameters()])
    return fits


BS_LIMIT = 2**30  # the bytes of cuda:0 the bs-find mode's process may allocate (set_per_process_memory_fraction)
TRIAL_STEPS = 2  # training steps at a size, as bs_find's trials take


def bs_find_limit(out: Path) -> dict:
    """learn.bs_find() of small_cnn on 3x64x64 images (fastai's Adam) under a BS_LIMIT memory fraction of cuda:0;
    then whether TRIAL_STEPS training steps run at the size found, and at twice it."""
    device = ddist.device()
    torch.cuda.set_per_process_memory_fraction(BS_LIMIT / torch.cuda.get_device_properties(0).total_memory, 0)
    x, y = random_images(2048, 64)
    dls = DataLoaders(DataLoader(TensorDataset(x[256:], y[256:]), bs=32, drop_last=True),
                      DataLoader(TensorDataset(x[:256], y[:256]), bs=64), device=device)
    learn = Learner(dls, small_cnn(), loss_func=nn.CrossEntropyLoss(), path=out)
    found = learn.bs_find()
    learn.create_opt()

    def steps(size: int) -> bool:
        """True if TRIAL_STEPS steps on the training set's first `size` items ran, False if out of memory."""
        learn.model.train()
        try:
            xb, yb = x[256:256 + size].to(device), y[256:256 + size].to(device)
            for _ in range(TRIAL_STEPS):
                learn.loss_func(learn.model(xb), yb).backward()
                learn.opt.step()
                learn.opt.zero_grad()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            learn.opt.zero_grad()
            xb = yb = None
            torch.cuda.empty_cache()
    return dict(found=found, items=len(x) - 256, limit=BS_LIMIT, at_found=steps(found), at_double=steps(2 * found))


MODES = {"gc": gc, "shard": shard, "shard-gloo": shard_gloo, "memory-ddp": partial(memory, shard=False),
         "memory-shard": partial(memory, shard=True), "fsdp-bf16": fsdp_bf16, "recompute": recompute,
         "bs-find": bs_find_limit}

if __name__ == "__main__":
    seen = MODES[sys.argv[1]](Path(sys.argv[2]))
    torch.save(seen, Path(sys.argv[2]) / f"rank{ddipp.rank()}.pt")
