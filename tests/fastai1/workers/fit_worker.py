"""Launched on 2 ranks by tests/test_callbacks.py: runs the scenario under ddipp and saves what it saw.

Its temp folder is OUT/tmp, so that the test sees exactly what ddipp left there."""
import contextlib
import os
import sys
import tempfile
from pathlib import Path

out = Path(sys.argv[1])
(out / "tmp").mkdir(exist_ok=True)
os.environ["TMPDIR"] = tempfile.tempdir = str(out / "tmp")

import torch  # noqa: E402

torch.set_num_threads(1)

import ddipp  # noqa: E402
from scenario import (EpochOrders, between_fits, csv_fits, decisions, digits_data, digits_learner,  # noqa: E402
                      evaluation, exported, failed_fit, story, sweep, swept_state, tabular_digits_learner)
from strategy_story import second_strategy  # noqa: E402

rank = ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {"story": story(digits_learner(digits_data(out / "work", bs=16)).to_ddp())}
    learn = digits_learner(digits_data(out / "work", bs=16)).to_ddp(lr_find_mode="distributed")
    res["distributed_sweep"] = sweep(learn)
    learn = digits_learner(digits_data(out / "work", bs=16, n_valid=1734)).to_ddp(lr_find_mode="distributed")
    res["short_shard_sweep"] = sweep(learn, num_it=100)  # 1 batch a rank an epoch; fastai plans 68 epochs
    res["solo_sweep"] = swept_state(digits_learner(digits_data(out / "work", bs=16)).to_ddp())
    learn = digits_learner(digits_data(out / "work", bs=16, val_bs=2, n_valid=3)).to_ddp()
    learn.fit(1, 1e-2)
    res["tiny_valid"] = learn.recorder.val_losses + learn.recorder.metrics[0][:2]
    learn = digits_learner(digits_data(out / "work", bs=16, shuffle=True)).to_ddp()
    learn.callback_fns.append(EpochOrders)
    learn.fit(3, 1e-2)
    res["orders"] = learn.epoch_orders.orders
    res["failed_fit"] = failed_fit(digits_learner(digits_data(out / "work", bs=16)).to_ddp())
    res["csv_fits"] = csv_fits(lambda: digits_learner(digits_data(out / "csv", bs=16)).to_ddp())
    res["decisions"] = decisions(digits_learner(digits_data(out / "work", bs=16)).to_ddp())
    res["exported"] = exported(tabular_digits_learner(out / "work").to_ddp())
    res["between_fits"] = between_fits(digits_learner(digits_data(out / "work", bs=16)).to_ddp(), bs=16)
    res["second_strategy"] = second_strategy(
        lambda: digits_learner(digits_data(out / "strategy", bs=16)).to_ddp(lr_find_mode="distributed"),
        fit=lambda learn: learn.fit_one_cycle(1, 1e-2, callbacks=[ddipp.Checkpoint(learn, "stub")]),
        sweep=lambda learn: learn.lr_find(num_it=5),
        resume=lambda learn: learn.fit_one_cycle(2, 1e-3, start_epoch=1, callbacks=[ddipp.Checkpoint(learn, "stub")]))
    alone = digits_learner(digits_data(out / "work", bs=16)).to_ddp()
    alone.fit(1, 1e-2)
torch.save(res, out / f"rank{rank}.pt")
if rank == 0:  # rank 1 has saved its results and is leaving: whatever rank 0 does now, it does alone
    with open(out / "stdout0.txt", "a") as log, contextlib.redirect_stdout(log):
        try:
            res["rank0_alone"] = evaluation(alone)
        except Exception as e:  # a collective with a rank that left
            res["rank0_alone"] = f"{type(e).__name__}: {e}"
    torch.save(res, out / f"rank{rank}.pt")
