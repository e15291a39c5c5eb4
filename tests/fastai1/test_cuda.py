"""GPU-only paths, skipped without CUDA: NCCL under the launcher on a chosen GPU, and notebook mode on a GPU
from a process that already used CUDA. Both must train what one CPU process trains (to float tolerance)."""
import subprocess
import sys

import pytest
import torch

import ddipp
from ddipp.core.group import forkserver
from ddipp.core.group.group import _groups
from ddipp.fastai1.notebook.fitting import place_data
from compare import close, max_diff
from scenario import digits_data, digits_learner, history, params

from conftest import WORKERS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_TOL = 1e-4  # cuBLAS sums in another order than the CPU


@pytest.fixture(scope="module")
def cpu_fit(tmp_path_factory):
    learn = digits_learner(digits_data(tmp_path_factory.mktemp("cpu"), bs=32))
    learn.fit(2, 1e-2)
    return history(learn), params(learn)


@pytest.mark.slow
def test_a_launched_rank_trains_on_the_listed_gpu_with_nccl(tmp_path, cpu_fit):
    last = torch.cuda.device_count() - 1
    subprocess.run([sys.executable, "-m", "ddipp.launch", "--gpus", str(last), str(WORKERS / "cuda_worker.py"),
                    str(tmp_path)], check=True, timeout=600)
    got = torch.load(tmp_path / "rank0.pt")
    assert got["backend"] == "nccl" and got["device"] == got["param_device"] == f"cuda:{last}"
    assert close(got["history"], cpu_fit[0], GPU_TOL) and max_diff(got["params"], cpu_fit[1]) <= GPU_TOL


@pytest.mark.slow
@pytest.mark.parametrize("forked", [False, True], ids=["spawned", "forked"])
def test_notebook_mode_on_a_gpu_after_this_process_used_cuda(tmp_path, cpu_fit, forked):
    """Forked: the workers come from a kernel's fork server, which must not have touched CUDA."""
    if forked:
        forkserver.start(forkserver.worker_modules("ddipp.fastai1.notebook.fitting"))
    here = torch.device("cuda", 0)
    learn = digits_learner(place_data(digits_data(tmp_path, bs=32), here))
    learn.model.to(here)  # this process has a CUDA context now: fork-based launchers would refuse
    learn.to_ddp(gpus=[torch.cuda.device_count() - 1])
    learn.fit(2, 1e-2)
    procs = _groups[(f"cuda:{torch.cuda.device_count() - 1}",)].procs
    ddipp.shutdown()
    forkserver.stop()
    assert all(isinstance(p, forkserver.ForkedWorker) and p.spawned is None for p in procs) == forked
    assert all(p.device == here for p in learn.model.parameters())
    assert close(history(learn), cpu_fit[0], GPU_TOL)
    assert max_diff([p.cpu() for p in params(learn)], cpu_fit[1]) <= GPU_TOL


@pytest.mark.slow
def test_mixed_precision_in_a_notebook_fit_on_a_gpu_trains_as_a_local_one(tmp_path):
    """fastai's MixedPrecision (to_fp16) among the callbacks a notebook-mode fit runs (issue 13's list)."""
    here = torch.device("cuda", 0)

    def trained(path, bound):
        learn = digits_learner(place_data(digits_data(path, bs=32), here)).to_fp16()
        learn.model.to(here)
        if bound:
            learn.to_ddp(gpus=[0])
        learn.fit(2, 1e-2)
        return history(learn), [p.float().cpu() for p in params(learn)]
    (remote_history, remote_params), (local_history, local_params) = trained(tmp_path / "nb", True), trained(
        tmp_path / "local", False)
    assert close(remote_history, local_history, 1e-2) and max_diff(remote_params, local_params) <= 1e-2
    ddipp.shutdown()
