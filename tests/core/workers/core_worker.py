"""Launched on 2 CPU ranks by tests/core/test_collectives.py, test_syncbn.py and test_fit.py (`core_ranks`):
ddipp.core's collectives, SyncBatchNorm and a step's loss all-reduce in plain torch; rank r saves what it saw in
OUT/rank{r}.pt."""
import sys
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from core_story import (bn_model, bn_train, embedding_net, features, losses_and_grads, moment_sums,  # noqa: E402
                        pair_batch)
from ddipp.core import dist as ddist  # noqa: E402
from ddipp.core.collectives import all_gather, reduce_sum  # noqa: E402
from ddipp.core.fit import LossAndStop  # noqa: E402
from ddipp.core.syncbn import convert_sync_bn  # noqa: E402

out = Path(sys.argv[1])
assert ddist.init()
rank = ddist.rank()


def naive_gather(t):
    """The gather users write with plain torch.distributed: no gradient reaches the other ranks' parts."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach())
    parts[rank] = t
    return torch.cat(parts)


res = {}
x, views, y = pair_batch()
mine = slice(rank * len(x) // 2, (rank + 1) * len(x) // 2)  # contiguous halves: gathered in rank order = x
model = DistributedDataParallel(embedding_net())
res["grads"] = losses_and_grads(model, x[mine], views[mine], y[mine], gather=all_gather)
res["grads_naive"] = losses_and_grads(model, x[mine], views[mine], y[mine], gather=naive_gather)
res["grads_local"] = losses_and_grads(model, x[mine], views[mine], y[mine])
res["uneven_gather"] = all_gather(torch.full((rank + 1, 2), float(rank)))

feats = features()
for dtype in (torch.float64, torch.float32):
    state = moment_sums(feats[rank::2].to(dtype))  # 51 and 50 of the 101 vectors
    before = {k: v.clone() for k, v in state.items()}
    res[f"reduced_{dtype}"] = reduce_sum(state)
    res[f"inputs_kept_{dtype}"] = all(torch.equal(state[k], before[k]) for k in state)

half = slice(rank * 16, (rank + 1) * 16)  # this rank's half of each global batch of 32
model = bn_model()
undo = convert_sync_bn(model)
res["bn_type"] = type(model[1]).__name__
res["bn"] = bn_train(model, half, DistributedDataParallel(model), validate=rank == 0)  # would hang if eval synced
undo()
res["bn_plain_after"] = type(model[1]) is torch.nn.BatchNorm1d
model = bn_model()
res["bn_unsynced"] = bn_train(model, half, DistributedDataParallel(model), validate=False)

store, res["loss_and_stop"] = dist.distributed_c10d._get_default_store(), []
for stop in (False, True):
    ddist.request_stop(stop and rank == 1)  # the second step's stop is asked on rank 1 only
    if rank == 1:  # joins the all-reduce once rank 0's LossAndStop returned: one that waited for rank 1 never would
        store.wait([f"rank 0 started, stop={stop}"], timedelta(seconds=20))
    step_loss = LossAndStop(torch.tensor(float(rank + 1)), summed=False, world_size=2)
    if rank == 0:
        store.set(f"rank 0 started, stop={stop}", "1")
    loss, stopping = step_loss.result()
    res["loss_and_stop"].append((float(loss), stopping))
ddist.request_stop(False)
torch.save(res, out / f"rank{rank}.pt")
