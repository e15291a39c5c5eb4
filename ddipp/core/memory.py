"""Giving back what a finished fit held: Python's garbage and, with CUDA, the allocator's cached blocks."""
import gc

import torch

from . import dist as ddist


def release_memory(verbose: bool = False) -> None:
    """`gc.collect()` and, with CUDA, `torch.cuda.empty_cache()`; with `verbose`, say what was freed on this rank."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    reserved = torch.cuda.memory_reserved() if cuda else 0
    objects = gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if verbose:
        freed = (reserved - torch.cuda.memory_reserved()) / 2**20 if cuda else 0.0
        print(f"GCCallback (rank {ddist.rank()}): collected {objects} objects, released {freed:.1f} MiB of CUDA cache")
