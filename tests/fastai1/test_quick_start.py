"""README.md's quick start for fastai v1, run as written on CPU: its notebook cells in a Jupyter kernel, its script
under its launch command, each training on 2 processes (the quick start reaches 0.96-0.98 accuracy here)."""
import pytest

from conftest import check_quick_start_notebook, check_quick_start_script

# the notebook's last cell: final accuracy, training steps the recorder saw, one process's steps an epoch, workers
# (forked by the fork server `import ddipp` started in the kernel)
CHECK = """import json, psutil
from ddipp.core.group import forkserver
workers = psutil.Process(forkserver.server().proc.pid).children()
print(json.dumps(dict(accuracy=float(learn.recorder.metrics[-1][0]), steps=len(learn.recorder.losses),
                      steps_of_one_process=len(data.train_dl), workers=len(workers))))"""


@pytest.mark.slow
def test_notebook_trains_on_2_worker_processes(tmp_path):
    check_quick_start_notebook(1, CHECK, tmp_path)


@pytest.mark.slow
def test_script_trains_on_2_launched_processes(tmp_path):
    check_quick_start_script(1, tmp_path)
