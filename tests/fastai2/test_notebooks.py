"""The fastai v2 example notebooks (examples/notebooks/fastai2), run top to bottom in a real Jupyter kernel on CPU.

The kernel is this Python's (the .venv2 one: jupyter_client starts the "python3" kernel with sys.executable). Each
notebook binds its learner with `learn.to_ddp(nprocs=2)` and must run without error, draw fastprogress's HTML bars and
results table in its cells, print the validation metric of its final model within a stated bound, and leave the
notebook's learner with the weights rank 0 trained: the notebook saves its learner right after a fit whose
SaveModelCallback made rank 0 write (and every rank reload) the best epoch. Rendered, it shows no stderr but the
warnings fastai gives for the notebook's own code in a plain notebook too, and no learner's repr."""
import re
import sys

import pytest
import torch
from jupyter_client import KernelManager

from conftest import ROOT, notebook_outputs, run_notebook

NOTEBOOKS = ROOT / "examples" / "notebooks" / "fastai2"
# notebook: (the metric it prints as "validation <metric> <value>"; its bound; the file saved in the notebook; the
# file rank 0 saved). On CPU the notebooks reach: vision 0.894, tabular 0.925, collab 0.208, text 0.970, shard 0.828;
# one process (the notebook without its to_ddp line, so half the global batch): 0.878, 0.927, 0.175, 0.960, 0.867.
# The bounds leave a margin below (above for mse) both.
EXPECTED = {"lesson1_vision.ipynb": ("accuracy", 0.80, "stage-1", "best"),
            "tabular.ipynb": ("accuracy", 0.88, "tabular", "best"),
            "collab.ipynb": ("mse", 0.26, "collab", "best"),
            "text.ipynb": ("accuracy", 0.90, "clas", "best"),
            "shard.ipynb": ("accuracy", 0.75, "shard", "best")}
AT_MOST = {"mse"}  # bounds from above; the others are bounds from below
# What the notebooks' own code makes fastai print to stderr in a plain notebook (no ddipp): torch 2.14 deprecates
# torch.jit.script, which fastai.layers uses when fastai is imported; tensors fastai makes of a pandas 3 frame's
# read-only arrays (tabular, collab). Rank 0 meets the second one again in its first fit, and its stderr is relayed.
FASTAI_WARNINGS = (r"FutureWarning: `torch\.jit\.script` is deprecated", r"UserWarning: The given NumPy array is not "
                   r"writable, and PyTorch does not support non-writable tensors",
                   r"FutureWarning: You are using `torch\.load` with `weights_only=False`",  # fastai 2.7 on torch < 2.6
                   r"FutureWarning: Downcasting object dtype arrays on \.fillna")  # fastai 2.8.10's tabular on pandas 2
WARNING = re.compile(r"^\S+:\d+: (\w+: .*)\n(?:  .*\n)?", re.MULTILINE)  # what warnings.showwarning writes


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)


def test_the_kernel_is_this_python():
    assert KernelManager(kernel_name="python3").format_kernel_cmd()[0] == sys.executable


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def executed(request, tmp_path_factory):
    """A notebook run top to bottom in a kernel (once for the tests below): its name, cells, HTML displays, folder."""
    name, folder = request.param, tmp_path_factory.mktemp(request.param.split(".")[0])
    # the kernel's torch: one thread, as each worker's (a busy CPU starves more)
    notebook, html = run_notebook(NOTEBOOKS / name, folder, OMP_NUM_THREADS="1")
    return name, notebook, html, folder


def _weights(path):
    """The model's state in a file fastai saved (with or without the optimizer); the test's own file."""
    state = torch.load(path, weights_only=False)  # fastai's optimizer state holds more than tensors
    return state.get("model", state)


@pytest.mark.slow
def test_notebook_runs_and_brings_rank0s_training_back(executed):
    name, notebook, displays, folder = executed
    metric, bound, saved_here, saved_by_rank0 = EXPECTED[name]
    assert any(html.count("<progress") == 2 for html in displays)  # the master bar and an epoch's bar
    outputs = notebook_outputs(notebook)
    html = "".join(out.get("data", {}).get("text/html", "") for out in outputs)
    assert "<th>train_loss</th>" in html and "<th>valid_loss</th>" in html  # a results table, kept in the notebook
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    value = float(re.search(rf"validation {metric} (\d+\.\d+)", text).group(1))
    assert (value <= bound if metric in AT_MOST else value >= bound), text
    here, rank0 = (_weights(next(folder.rglob(f"{n}.pth"))) for n in (saved_here, saved_by_rank0))
    assert here.keys() == rank0.keys() and all(torch.equal(here[k], rank0[k]) for k in here)


def _unexplained(stderr: str) -> str:
    """What is left of `stderr` without the warnings fastai gives for the notebooks' code in a plain notebook."""
    return WARNING.sub(lambda m: "" if any(re.match(w, m.group(1)) for w in FASTAI_WARNINGS) else m.group(0), stderr)


@pytest.mark.slow
def test_notebook_shows_only_fastais_own_warnings_and_no_learner_repr(executed):
    """No red box but fastai's own: any other stderr is noise (torch's, ddipp's); to_ddp's cell ends with ';'."""
    _, notebook, _, _ = executed
    outputs = notebook_outputs(notebook)
    stderr = "".join(out.text for out in outputs if out.output_type == "stream" and out.name == "stderr")
    assert _unexplained(stderr) == ""
    assert not [out for out in outputs if out.get("data", {}).get("text/plain", "").startswith("<fastai.")]
