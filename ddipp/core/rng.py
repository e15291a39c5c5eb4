"""Random generator states (python, numpy, torch CPU, current CUDA) of every rank, as tensors and lists, so that a
checkpoint holding them is read back by a weights-only load, and a resumed fit draws what the interrupted one would."""
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

from . import dist as ddist


def seed_all(seed: int) -> None:
    """Seed python's, numpy's and torch's generators, as a script that seeds does."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> list:
    """This process's python, numpy, torch CPU and (if in use) current CUDA generator states, as tensors and lists."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    version, python, gauss = random.getstate()
    _, key, pos, has_gauss, cached = np.random.get_state()
    return [[version, list(python), gauss], [torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss),
                                            float(cached)], torch.get_rng_state(), cuda]


def set_rng_state(state: list) -> None:
    """Put back the generator states `rng_state()` returned."""
    python, (key, *numpy), torch_cpu, cuda = state
    random.setstate((python[0], tuple(python[1]), python[2]))
    np.random.set_state(("MT19937", key.numpy().astype(np.uint32), *numpy))
    torch.set_rng_state(torch_cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def every_rank(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] (a collective: call it on every rank); [obj] in a plain process."""
    if ddist.world_size() == 1 or not ddist.init():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def this_rank(states: list, source):
    """This rank's entry of `states` (one per rank of the group that wrote `source`); None, with a warning naming
    `source`, when that group had another size (the generators cannot be matched to ranks)."""
    if len(states) != ddist.world_size():
        warnings.warn(f"{source} was written by {len(states)} ranks, this group has {ddist.world_size()}: "
                      "random number generators are not restored (dropout and augmentation draws will differ)")
        return None
    return states[ddist.rank()]
