"""Launched on 2 ranks by the tests of issue-6 features (tests/test_collectives.py and siblings): saves what it saw."""
import contextlib
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

import ddipp  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from beyond import (bn_fit, bn_learner, embedding_net, features, losses_and_grads,  # noqa: E402
                    moment_sums, moments_fit, pair_batch, pairs_data, pairs_fit, pairs_learner, resume_story,
                    throughput_fit)
from scenario import digits_data, digits_learner, params  # noqa: E402

out = Path(sys.argv[1])
rank = ddipp.rank()
replaced = []  # the checkpoint files this rank moved into place
_replace = os.replace
os.replace = lambda src, dst: replaced.append(str(dst)) or _replace(src, dst)


def naive_gather(t):
    """The gather users write with plain torch.distributed: no gradient reaches the other ranks' parts."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach())
    parts[rank] = t
    return torch.cat(parts)


with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {}
    ddipp.core.dist.init()
    x, views, y = pair_batch()
    mine = slice(rank * len(x) // 2, (rank + 1) * len(x) // 2)  # contiguous halves: gathered in rank order = x
    model = DistributedDataParallel(embedding_net())
    res["grads"] = losses_and_grads(model, x[mine], views[mine], y[mine], gather=ddipp.all_gather)
    res["grads_naive"] = losses_and_grads(model, x[mine], views[mine], y[mine], gather=naive_gather)
    res["grads_local"] = losses_and_grads(model, x[mine], views[mine], y[mine])
    res["uneven_gather"] = ddipp.all_gather(torch.full((rank + 1, 2), float(rank)))

    learn = pairs_learner(pairs_data(out / "work", bs=16)).to_ddp()
    learn.callback_fns.append(ddipp.GlobalBatchLoss)
    res["pairs"] = pairs_fit(learn)
    res["pairs_local"] = pairs_fit(pairs_learner(pairs_data(out / "work", bs=16)).to_ddp())

    feats = features()
    for dtype in (torch.float64, torch.float32):
        state = moment_sums(feats[rank::2].to(dtype))  # 51 and 50 of the 101 vectors
        before = {k: v.clone() for k, v in state.items()}
        res[f"reduced_{dtype}"] = ddipp.reduce_sum(state)
        res[f"inputs_kept_{dtype}"] = all(torch.equal(state[k], before[k]) for k in state)
    res["moments"] = moments_fit(digits_learner(digits_data(out / "work", bs=16)).to_ddp())

    res["bn"] = bn_fit(bn_learner(digits_data(out / "work", bs=16)).to_ddp(sync_bn=True))
    res["bn_unsynced"] = bn_fit(bn_learner(digits_data(out / "work", bs=16)).to_ddp())

    replaced.clear()
    res["resume"] = resume_story(out / "work")
    res["replaced"] = list(replaced)

    res["throughput"] = throughput_fit(digits_learner(digits_data(out / "work", bs=16, shuffle=True)).to_ddp(),
                                       compare_batches=4)
    learn = digits_learner(digits_data(out / "work", bs=16, shuffle=True)).to_ddp()
    learn.fit(2, 1e-2)
    res["no_throughput"] = params(learn)
torch.save(res, out / f"rank{rank}.pt")
