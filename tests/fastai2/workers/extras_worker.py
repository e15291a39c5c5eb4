"""Launched on 2 ranks by tests/fastai2/test_{losses,metrics,checkpoint,throughput,wrapped_model,cpu_bf16,
memory_page}.py: plays extras.py's stories (and wrapped_model.py's, docs/memory.md's script) with batch 16 a rank under ddipp and saves
what each rank saw in OUT/rank{r}.pt (stdout in OUT/stdout{r}.txt)."""
import contextlib
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from memory_page import run_page  # noqa: E402
from wrapped_model import compiled_story  # noqa: E402
from extras import (digits_dls, digits_learner, moments_fit, pairs_dls, pairs_fit, pairs_learner,  # noqa: E402
                    params, resume_story, throughput_fit)

out = Path(sys.argv[1])
rank = ddipp.rank()
replaced = []  # the files this rank moved into place
_replace = os.replace
os.replace = lambda src, dst: replaced.append(str(dst)) or _replace(src, dst)

with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {"pairs": pairs_fit(pairs_learner(pairs_dls(bs=16)).to_ddp().add_cb(ddipp.GlobalBatchLoss())),
           "pairs_local": pairs_fit(pairs_learner(pairs_dls(bs=16)).to_ddp()),
           "moments": moments_fit(digits_learner(digits_dls(bs=16)).to_ddp())}
    replaced.clear()
    res["resume"] = resume_story(out / "work")
    res["replaced"] = list(replaced)
    res["throughput"] = throughput_fit(digits_learner(digits_dls(bs=16, shuffle=True)).to_ddp(), compare_batches=4)
    learn = digits_learner(digits_dls(bs=16, shuffle=True)).to_ddp()
    learn.fit(2, 1e-2)
    res["no_throughput"] = params(learn)
    learn = digits_learner(digits_dls(bs=16, shuffle=True)).to_bf16().to_ddp()  # on CPU: no_throughput's fit
    learn.fit(2, 1e-2)
    res["bf16"] = params(learn)
    res["compiled"] = compiled_story(out / "compiled", bs=16)
    res["memory_page"] = run_page()
torch.save(res, out / f"rank{rank}.pt")
