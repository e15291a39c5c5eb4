"""README.md's quick start for fastai v2, run as written on CPU: its notebook cells in a Jupyter kernel, its script
under its launch command. Each must train on 2 processes to an accuracy only a trained model reaches on the digits
(an untrained one guesses 0.1; the quick start reaches 0.97-0.98 here)."""
import re

from conftest import run_quick_start_notebook, run_quick_start_script

BOUND = 0.93
# Printed by the notebook's last cell: the final accuracy, the training steps the recorder saw and the steps one
# process takes an epoch, and the notebook's ddipp worker processes
CHECK = """import json, psutil
workers = [p for p in psutil.Process().children() if "ddipp.core.group.worker" in " ".join(p.cmdline())]
print(json.dumps(dict(accuracy=float(learn.recorder.values[-1][-1]), steps=len(learn.recorder.losses),
                      steps_of_one_process=len(dls.train), workers=len(workers))))"""


def test_notebook_trains_on_2_worker_processes(tmp_path):
    cells, result = run_quick_start_notebook(2, CHECK, tmp_path)
    [to_ddp] = [cell for cell in cells if ".to_ddp(" in cell.source]
    assert "execute_result" not in [out.output_type for out in to_ddp.outputs], to_ddp.outputs  # the ';'
    assert "ddipp: global batch 64 = 32 per process x 2" in "".join(out.get("text", "") for out in to_ddp.outputs)
    assert result["workers"] == 2
    assert result["steps"] == 3 * (result["steps_of_one_process"] // 2), result  # 3 epochs of half the steps
    assert result["accuracy"] >= BOUND, result


def test_script_trains_on_2_launched_processes(tmp_path):
    printed = run_quick_start_script(2, tmp_path)
    processes, accuracy = re.search(r"^(\d+) processes: accuracy ([\d.]+)$", printed, re.MULTILINE).groups()
    assert int(processes) == 2, printed
    assert float(accuracy) >= BOUND, printed
