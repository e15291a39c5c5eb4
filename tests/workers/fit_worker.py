"""Launched on 2 ranks by tests/test_callbacks.py: runs the scenario under ddipp and saves what it saw."""
import contextlib
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

import ddipp  # noqa: E402
from scenario import (EpochOrders, between_fits, decisions, digits_data, digits_learner, exported,  # noqa: E402
                      failed_fit, story, sweep, tabular_digits_learner)

out = Path(sys.argv[1])
rank = ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {"story": story(digits_learner(digits_data(out / "work", bs=16)).to_ddp())}
    learn = digits_learner(digits_data(out / "work", bs=16)).to_ddp(lr_find_mode="distributed")
    res["distributed_sweep"] = sweep(learn)
    learn = digits_learner(digits_data(out / "work", bs=16, val_bs=2, n_valid=3)).to_ddp()
    learn.fit(1, 1e-2)
    res["tiny_valid"] = learn.recorder.val_losses + learn.recorder.metrics[0][:2]
    learn = digits_learner(digits_data(out / "work", bs=16, shuffle=True)).to_ddp()
    learn.callback_fns.append(EpochOrders)
    learn.fit(3, 1e-2)
    res["orders"] = learn.epoch_orders.orders
    res["failed_fit"] = failed_fit(digits_learner(digits_data(out / "work", bs=16)).to_ddp())
    res["decisions"] = decisions(digits_learner(digits_data(out / "work", bs=16)).to_ddp())
    res["exported"] = exported(tabular_digits_learner(out / "work").to_ddp())
    res["between_fits"] = between_fits(digits_learner(digits_data(out / "work", bs=16)).to_ddp(), bs=16)
torch.save(res, out / f"rank{rank}.pt")
