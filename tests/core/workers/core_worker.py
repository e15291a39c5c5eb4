"""Launched on 2 CPU ranks by tests/core/test_collectives.py, test_syncbn.py, test_fit.py, test_state.py and
test_parallel.py (`core_ranks`): ddipp.core's collectives, SyncBatchNorm, a step's loss all-reduce, and a fit's whole
state read and loaded through its Strategy (DDP, a stub in its place, and Shard) in plain torch; rank r saves what it
saw in OUT/rank{r}.pt."""
import copy
import sys
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from core_story import (STATE_BS, STATE_STEPS, adam, adam_steps, bn_model, bn_train, embedding_net,  # noqa: E402
                        features, losses_and_grads, moment_sums, pair_batch, state_batches)
from ddipp.core import dist as ddist  # noqa: E402
from ddipp.core import parallel  # noqa: E402
from ddipp.core.collectives import all_gather, reduce_sum  # noqa: E402
from ddipp.core.fit import LossAndStop  # noqa: E402
from ddipp.core.options import Options  # noqa: E402
from ddipp.core.state import full_state, load_full_state  # noqa: E402
from ddipp.core.syncbn import convert_sync_bn  # noqa: E402
from stub_strategy import HandAveraged  # noqa: E402

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

batches, state_half = state_batches(), slice(rank * STATE_BS // 2, (rank + 1) * STATE_BS // 2)


def adapter_fit(options: Options = Options()):
    """What an adapter's DistributedCallback does with a fit's strategy, in plain torch: built by parallel.strategy,
    the model wrapped for the fit (this rank's half of each batch) and put back after it, its whole state read through
    the strategy; the strategy's class name, the state, and whether a parameter had a hook during the fit and after."""
    strategy = parallel.strategy(options)
    net = embedding_net()
    opt = adam(net)
    with ExitStack() as undo:
        model = strategy.wrap(net, opt, undo)
        adam_steps(model, opt, batches[:STATE_STEPS], state_half)
        state = copy.deepcopy(full_state(model, opt, strategy))
        hooked = any(p._post_accumulate_grad_hooks for p in net.parameters())
    return dict(strategy=type(strategy).__name__, state=state,
                hooked=(hooked, any(p._post_accumulate_grad_hooks for p in net.parameters())))


res["ddp_fit"] = adapter_fit()
chosen = parallel.strategy
parallel.strategy = lambda options: HandAveraged(options)
try:
    res["stub_fit"] = adapter_fit()
finally:
    parallel.strategy = chosen

ddp, net = parallel.DDP(Options()), embedding_net()
opt = adam(net, lr=1.0)  # a fresh optimizer, its own learning rate: the state loaded brings 0.01 back
with ExitStack() as undo:
    model = ddp.wrap(net, opt, undo)
    load_full_state(model, opt, copy.deepcopy(res["ddp_fit"]["state"]), ddp)  # torch's optimizer takes its tensors
    res["loaded"] = copy.deepcopy(dict(model=net.state_dict(), opt=opt.state_dict()))
    adam_steps(model, opt, batches[STATE_STEPS:], state_half)
    res["after_load"] = copy.deepcopy(full_state(model, opt, ddp))

res["shard_fit"] = adapter_fit(Options(shard=True))  # rank 0 holds the state, gathered; rank 1 None
shard, net = parallel.strategy(Options(shard=True)), embedding_net()
opt = adam(net, lr=1.0)
with ExitStack() as undo:
    model = shard.wrap(net, opt, undo)
    load_full_state(model, opt, copy.deepcopy(res["shard_fit"]["state"]), shard)  # rank 0's alone: sent to rank 1
    adam_steps(model, opt, batches[STATE_STEPS:], state_half)
    res["shard_after_load"] = copy.deepcopy(full_state(model, opt, shard))
res["shard_whole_after"] = copy.deepcopy(dict(model=net.state_dict(), opt=opt.state_dict()))  # gathered back
torch.save(res, out / f"rank{rank}.pt")
