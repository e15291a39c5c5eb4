"""The trials that tests/core/test_batch_size.py searches, in one process and on 2 launched ranks."""
import torch
from torch import nn

CEILINGS = (400, 168)  # the largest size each rank takes (rank 1: less memory free), as issue 44's probe measured


def ceiling_trial(ceiling: int, verdicts: list, error: Exception = None):
    """A trial: one SGD step of a small model on `size` random items, raising `error` (torch's out of memory by
    default) before it above `ceiling`; each local verdict goes to `verdicts`."""
    def trial(size: int) -> None:
        verdicts.append((size, size <= ceiling))
        if size > ceiling:
            raise error or torch.OutOfMemoryError(f"simulated: {size} items above this rank's ceiling {ceiling}")
        model = nn.Linear(4, 2)
        nn.functional.cross_entropy(model(torch.randn(size, 4)), torch.randint(0, 2, (size,))).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return trial
