"""Launched on 2 ranks by the fastai v1 tests of issue-6 features (tests/fastai1/test_syncbn.py and siblings): saves
what it saw."""
import contextlib
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from beyond import (bn_fit, bn_learner, moments_fit, pairs_data, pairs_fit, pairs_learner, resume_story,  # noqa: E402
                    throughput_fit)
from fastai.torch_core import defaults  # noqa: E402
from scenario import digits_data, digits_learner, params  # noqa: E402

out = Path(sys.argv[1])
rank = ddipp.rank()
replaced = []  # the checkpoint files this rank moved into place
_replace = os.replace
os.replace = lambda src, dst: replaced.append(str(dst)) or _replace(src, dst)

with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    ddipp.core.dist.init()
    res = {"device": str(ddipp.device()), "fastai_device": str(defaults.device)}
    learn = pairs_learner(pairs_data(out / "work", bs=16)).to_ddp()
    learn.callback_fns.append(ddipp.GlobalBatchLoss)
    res["pairs"] = pairs_fit(learn)
    res["pairs_local"] = pairs_fit(pairs_learner(pairs_data(out / "work", bs=16)).to_ddp())

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
