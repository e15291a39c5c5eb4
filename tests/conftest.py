"""Shared fixtures: tiny data sets made on the spot (no downloads), a one-thread torch, and the scenario
(tests/fastai1/workers/scenario.py) played once launched on 2 ranks and once in one process, for every module.

The tests and every process they start (launched ranks, notebooks, worker groups) import the helpers of IMPORT_PATHS:
this conftest puts them on sys.path and on PYTHONPATH, once, so no test or worker file edits sys.path."""
import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
FASTAI_MAJOR = int(version("fastai").split(".")[0])  # as ddipp picks its adapter; this env runs tests/fastai{N}
WORKERS = ROOT / "tests" / f"fastai{FASTAI_MAJOR}" / "workers"  # the scripts and helpers of this env's fastai tests
# examples/ (digits), tests/ (compare), the torch-only core workers, this fastai's workers
IMPORT_PATHS = [str(ROOT / "examples"), str(ROOT / "tests"), str(ROOT / "tests" / "core" / "workers"), str(WORKERS)]
sys.path[:0] = [*IMPORT_PATHS, str(ROOT / "tools")]  # tools/: for the tests of the tools alone
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def importable_in_subprocesses():
    """IMPORT_PATHS on PYTHONPATH for every process a test starts (the launcher and a worker group pass it on)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [*IMPORT_PATHS, os.environ.get("PYTHONPATH")])))
        yield


@pytest.fixture(autouse=True)
def fork_server(request, importable_in_subprocesses):
    """The fastai tests' worker groups are forked from a fork server, as a Jupyter kernel's are (one for the session);
    the core tests' are not: they test the group with and without one."""
    from ddipp.core.group import forkserver
    if request.path.relative_to(ROOT / "tests").parts[0] == "core":
        forkserver.stop()
    else:
        forkserver.start(forkserver.worker_modules(f"ddipp.fastai{FASTAI_MAJOR}.notebook.fitting"))


@pytest.fixture(scope="session")
def digits_path(tmp_path_factory):
    from digits import digits_folder
    return digits_folder(tmp_path_factory.mktemp("data") / "digits")


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    """What tests/workers/fit_worker.py saw on each of 2 launched ranks (per-rank batch 16), and its folder."""
    out = tmp_path_factory.mktemp("ddp")
    launch_2_ranks(WORKERS / "fit_worker.py", out)
    return rank_files(out), out


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The scenario's story in one process with batch 32, the global batch of 2 ranks."""
    from scenario import digits_data, digits_learner, story
    return story(digits_learner(digits_data(tmp_path_factory.mktemp("ref"), bs=32)))


@pytest.fixture(scope="session")
def core_ranks(tmp_path_factory):
    """What tests/core/workers/core_worker.py (plain torch) saw on each of 2 launched ranks, and its folder."""
    out = tmp_path_factory.mktemp("core")
    launch_2_ranks(ROOT / "tests" / "core" / "workers" / "core_worker.py", out)
    return rank_files(out), out


@pytest.fixture(scope="session")
def beyond_ranks(tmp_path_factory):
    """What tests/workers/beyond_worker.py saw on each of 2 launched ranks, and its folder."""
    out = tmp_path_factory.mktemp("beyond")
    launch_2_ranks(WORKERS / "beyond_worker.py", out)
    return rank_files(out), out


@pytest.fixture
def extras_ranks(tmp_path_factory):
    """What tests/fastai2/workers/extras_worker.py saw on each of 2 launched ranks, and its folder (one run per
    session: extras.launched keeps it)."""
    from extras import launched
    return launched(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def split_reference(tmp_path_factory):
    """This fastai's split_story.py (tests/fastai{N}/workers) in one process, both batch settings."""
    from split_story import split_story
    return split_story(lambda learn, **options: learn, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def split_launched(tmp_path_factory):
    """What each of 2 launched ranks saw of the split story under split_batches, at bs=15: 8 + 7 a rank."""
    out = tmp_path_factory.mktemp("launched")
    launch_2_ranks(ROOT / "tests" / "workers" / "split_worker.py", out, args=["15"])
    return rank_files(out)


@pytest.fixture(scope="module")
def split_notebook(tmp_path_factory):
    """The split story on a notebook's 3 processes under split_batches, at bs=16: 6 + 5 + 5."""
    from split_story import split_story
    return split_story(lambda learn, **options: learn.to_ddp(nprocs=3, split_batches=True, **options),
                       tmp_path_factory.mktemp("notebook"), [(16, False)])


@pytest.fixture(scope="module")
def shard_launched(tmp_path_factory):
    """What each of 2 launched ranks saw of this fastai's shard_story.py under to_ddp(shard=True), batch 16 a rank,
    and its folder."""
    out = tmp_path_factory.mktemp("sharded")
    launch_2_ranks(WORKERS / "shard_worker.py", out)
    return rank_files(out), out


@pytest.fixture(scope="module")
def shard_reference(tmp_path_factory):
    """This fastai's shard_story.py in one process on the global batch of 2 ranks (32)."""
    from shard_story import shard_story
    return shard_story(lambda learn, **options: learn, tmp_path_factory.mktemp("one"), 32)


def launch_2_ranks(script: Path, out: Path, args: tuple = ()) -> None:
    """Run `script OUT *args` under ddipp's launcher on 2 CPU processes (a collective may wait 120 s); fail with its
    output."""
    proc = subprocess.run([sys.executable, "-m", "ddipp.launch", "--nproc", "2", "--timeout", "120", str(script),
                           str(out), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]


def rank_files(out: Path) -> list:
    """What each of 2 ranks saved in OUT/rank{r}.pt."""
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def launch_restartable(script: Path, out: Path, mode: str, nodes: int = 1) -> str:
    """Run `script OUT MODE` under ddipp's launcher on 2 CPU processes with --max-restarts 5, on one node or as 2
    nodes of one process each (two launches on this host, meeting on loopback); rank 0's output."""
    out.mkdir()
    args = [sys.executable, "-m", "ddipp.launch", "--max-restarts", "5", "--timeout", "60"]
    if nodes == 1:
        launches = [args + ["--nproc", "2"]]
    else:
        with socket.socket() as s:  # a free port for node 0's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launches = [args + ["--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                            "--master-port", str(port)] for node in range(2)]
    procs = [subprocess.Popen(cmd + [str(script), str(out), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in launches]
    said = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr[-5000:]
        said.append(stdout)
    return said[0]


def check_restart_said(said, models: Path) -> None:
    """What a notebook says (`said`: capsys's) of the second fit of a new group, whose rank 1 died before its first
    checkpoint and rank 0 as it wrote the checkpoint after batch 15 of epoch 1 in `models`: two restarts, then it
    resumed."""
    assert re.search(r"ddipp: ddipp worker rank 1 \(pid \d+, cpu\) was killed by SIGKILL;", said.err)
    assert re.search(r"ddipp: ddipp worker rank 0 \(pid \d+, cpu\) was killed by SIGKILL;", said.err)
    for k in (1, 2):
        assert f"ddipp: restart {k} of 2: a new group runs the fit again, from its Checkpoint if it has one" in said.err
    assert f"ddipp: restart 1: fit 2 starts from scratch (no checkpoint of this launch in {models}" in said.out
    assert f"ddipp: restart 2: fit 2 resumed after epoch 1 and 10 batches of epoch 2 from {models}" in said.out
    assert "ddipp: the fit completed after 2 restarts (new groups started in " in said.out
    assert not list(models.glob(".*.tmp"))  # the half-written file was swept


@contextlib.contextmanager
def launched_beside(args: list, out: Path, **env: str):
    """`python -m ddipp.launch --nproc 2 *args` started in the background (its stderr to OUT/stderr.txt, `env` set),
    for the test to wait on; stopped on leaving if it was not waited for (a selection of tests, a failure)."""
    with open(out / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ddipp.launch", "--nproc", "2", *map(str, args)],
                                env=dict(os.environ, **env), stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # the launcher stops its ranks
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_notebook(path: Path, folder: Path, **env: str) -> tuple:
    """The notebook at `path` run top to bottom in a Jupyter kernel of this Python, in `folder`, with IMPORT_PATHS
    importable and `env` set: its cells with their outputs, and every HTML display and display update it made (a
    finished bar's last update leaves only its table in the cells)."""
    import nbformat
    from nbclient import NotebookClient
    html = []

    class Recording(NotebookClient):
        def process_message(self, msg, cell, cell_index):
            html.append(msg["content"].get("data", {}).get("text/html", ""))
            return super().process_message(msg, cell, cell_index)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        notebook = nbformat.read(path, as_version=4)
        Recording(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return notebook, html


def notebook_outputs(notebook) -> list:
    """The outputs of a run notebook's code cells, in order."""
    return [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]


def image_folder(path: Path) -> Path:
    """48 random 8x8 RGB images in train/ and valid/ folders of two classes (dark and light)."""
    rng = np.random.default_rng(0)
    for i in range(48):
        label = ("dark", "light")[i % 2]
        folder = path / ("train" if i < 32 else "valid") / label
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 128, (8, 8, 3)) + 127 * (label == "light")
        Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return path


def tiny_cnn() -> nn.Module:
    """A small CNN of image_folder's images, with dropout (so a resume must restore the random state)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2),
                         nn.Linear(64, 2))


# The start of a `python -c` program in which ddipp cannot be imported (where a plain fastai user loads a file)
WITHOUT_DDIPP = """
import sys
class NoDdipp:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ddipp":
            raise ModuleNotFoundError(f"No module named {name!r} (ddipp is not installed here)")
sys.meta_path.insert(0, NoDdipp())
"""


def quick_start(major: int) -> tuple:
    """README.md's quick start for fastai v`major`: its notebook block's cells (split at blank lines), its script's
    file name and code, and its launch command's arguments (the block's one command, comments dropped)."""
    section = (ROOT / "README.md").read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    part = section.split(f"\n### fastai v{major}\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", part, re.MULTILINE | re.DOTALL)
    assert [lang for lang, _ in blocks] == ["python", "python", "bash"], blocks
    (_, notebook), (_, script), (_, command) = blocks
    [argv] = [args for args in (shlex.split(line, comments=True) for line in command.splitlines()) if args]
    return [cell.strip() for cell in notebook.split("\n\n")], re.match(r"# (\S+\.py)", script)[1], script, argv


QUICK_START_BOUND = 0.93  # accuracy only a trained model reaches on the digits (an untrained one guesses 0.1)


def check_quick_start_notebook(major: int, check: str, folder: Path) -> None:
    """The quick start's notebook cells for fastai v`major` run in a Jupyter kernel in `folder`, then `check`, a cell
    printing a JSON object of the final accuracy, the recorder's training steps, the steps one process takes an epoch
    and the kernel's ddipp workers: the `to_ddp` cell shows no value (its ';') and says the global batch, and 3
    epochs on 2 workers took half one process's steps each to a trained model's accuracy."""
    import nbformat
    cells = quick_start(major)[0] + [check]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), folder / "q.ipynb")
    notebook, _ = run_notebook(folder / "q.ipynb", folder, OMP_NUM_THREADS="1")
    [printed] = [out.text for out in notebook.cells[-1].outputs if out.get("name") == "stdout"]
    result = json.loads(printed)
    [to_ddp] = [cell for cell in notebook.cells if ".to_ddp(" in cell.source]
    assert "execute_result" not in [out.output_type for out in to_ddp.outputs], to_ddp.outputs
    assert "ddipp: global batch 64 = 32 per process x 2" in "".join(out.get("text", "") for out in to_ddp.outputs)
    assert result["workers"] == 2
    assert result["steps"] == 3 * (result["steps_of_one_process"] // 2), result
    assert result["accuracy"] >= QUICK_START_BOUND, result


def check_quick_start_script(major: int, folder: Path) -> None:
    """The quick start's script for fastai v`major` written in `folder` and run there by its launch command (its
    `python` this Python) trains on 2 processes to a trained model's accuracy, as it prints."""
    _, name, script, argv = quick_start(major)
    assert argv[0] == "python", argv
    (folder / name).write_text(script)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=folder, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    processes, accuracy = re.search(r"^(\d+) processes: accuracy ([\d.]+)$", proc.stdout, re.MULTILINE).groups()
    assert int(processes) == 2, proc.stdout
    assert float(accuracy) >= QUICK_START_BOUND, proc.stdout
