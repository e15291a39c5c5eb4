"""ddipp.files: a process killed while writing leaves the previous file whole, and what it left is swept later."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from ddipp.core.files import owned_dir_prefix, save_atomic, sweep_stale_dirs

KILLED_MIDWAY = """
import os, sys, torch
from pathlib import Path
from ddipp.core.files import replacing
with replacing(Path(sys.argv[1])) as f:
    f.write(b"half a checkpoint")
    f.flush()
    os._exit(9)  # killed before the write completes: no finally runs
"""


@pytest.mark.slow
def test_a_process_killed_midway_leaves_the_previous_file_and_the_next_write_sweeps_its_part(tmp_path):
    path = tmp_path / "models" / "best.pth"
    save_atomic({"epoch": 1}, path)
    proc = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, str(path)])
    assert proc.returncode == 9
    assert torch.load(path) == {"epoch": 1}
    left = sorted(p.name for p in path.parent.iterdir())
    assert len(left) == 2 and left[0].startswith(".best.pth.") and left[0].endswith(".tmp")
    save_atomic({"epoch": 2}, path)
    assert torch.load(path) == {"epoch": 2}
    assert [p.name for p in path.parent.iterdir()] == ["best.pth"]


@pytest.mark.slow
def test_folders_of_dead_processes_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"ddipp-workers-{dead.stdout.strip()}-abc"
    mine = tempfile.mkdtemp(prefix=owned_dir_prefix("ddipp-workers"), dir=tmp_path)
    other = tmp_path / "ddipp-workers-notapid-x"
    for folder in (gone, other):
        folder.mkdir()
    (gone / "rank0.log").write_text("left by a killed notebook")
    sweep_stale_dirs(tmp_path, "ddipp-workers")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(mine), other.name])
