"""The example notebooks, run top to bottom in a real Jupyter kernel (nbclient + ipykernel) on CPU.

Each must run without error, draw fastprogress's HTML bars and results table in its cells, print the validation
metric of its final model within a stated bound, and leave the notebook's learner with the weights rank 0 trained:
the notebook saves its learner right after a fit whose SaveModelCallback made rank 0 write (and every rank reload)
the best epoch. Rendered, it shows no stderr (its own code warns of nothing) and no learner's repr."""
import re

import pytest
import torch

import ddipp  # noqa: F401  (fastai's saved files hold numpy scalars, which ddipp.compat allows in torch.load)

from conftest import ROOT, notebook_outputs, run_notebook

NOTEBOOKS = ROOT / "examples" / "notebooks"
# notebook: (the metric it prints as "validation <metric> <value>"; the bound (one process reaches, on CPU:
# tabular 0.933, collab 0.135, text 0.985); the file saved in the notebook; the file rank 0 saved)
EXPECTED = {"vision_digits.ipynb": ("accuracy", 0.85, "stage-2", "best"),
            "to_ddp_after_local.ipynb": ("accuracy", 0.93, "after-ddp", "best"),
            "tabular.ipynb": ("accuracy", 0.90, "tabular", "best"),
            "collab.ipynb": ("mse", 0.18, "collab", "best"),
            "text.ipynb": ("accuracy", 0.93, "clas", "best")}
AT_MOST = {"mse"}  # bounds from above; the others are bounds from below


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def executed(request, tmp_path_factory):
    """A notebook run top to bottom in a kernel (once for the tests below): its name, cells, HTML displays, folder."""
    name, folder = request.param, tmp_path_factory.mktemp(request.param.split(".")[0])
    notebook, html = run_notebook(NOTEBOOKS / name, folder)
    return name, notebook, html, folder


@pytest.mark.slow
def test_notebook_runs_and_brings_rank0s_training_back(executed):
    name, notebook, displays, folder = executed
    metric, bound, saved_here, saved_by_rank0 = EXPECTED[name]
    assert any(html.count("<progress") == 2 for html in displays)  # the master bar and an epoch's bar
    outputs = notebook_outputs(notebook)
    html = "".join(out.get("data", {}).get("text/html", "") for out in outputs)
    assert html.count("<th>train_loss</th>") >= 2  # the results tables, kept in the notebook
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    value = float(re.search(rf"validation {metric} (\d+\.\d+)", text).group(1))
    assert (value <= bound if metric in AT_MOST else value >= bound), text
    here, rank0 = (torch.load(next(folder.rglob(f"{n}.pth")))["model"] for n in (saved_here, saved_by_rank0))
    assert here.keys() == rank0.keys() and all(torch.equal(here[k], rank0[k]) for k in here)


@pytest.mark.slow
def test_notebook_shows_no_stderr_and_no_learner_repr(executed):
    """No red box: the notebooks' own code warns of nothing, so any stderr is noise (fastai's, torch's, ddipp's)."""
    _, notebook, _, _ = executed
    outputs = notebook_outputs(notebook)
    assert [out.text for out in outputs if out.output_type == "stream" and out.name == "stderr"] == []
    assert not [out for out in outputs if out.get("data", {}).get("text/plain", "").startswith("Learner(")]
