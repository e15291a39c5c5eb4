"""python -m ddipp.launch: the --gpus mapping, one-line errors for bad input, and real CPU launches."""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddipp.launch import PROG, parse_gpus

WORKERS = Path(__file__).parent / "workers"
ECHO, FAIL = WORKERS / "launch_echo.py", WORKERS / "launch_fail.py"
# fastai's import warns about pkg_resources in every launcher; pytest.ini ignores it the same way
ENV = dict(os.environ, PYTHONWARNINGS="ignore:pkg_resources is deprecated:UserWarning")
ENV.pop("OMP_NUM_THREADS", None)  # the launcher must set it to 1 itself


def launch(*args: str) -> subprocess.Popen:
    """Start `python -m ddipp.launch ARGS` with its output captured."""
    return subprocess.Popen([sys.executable, "-m", "ddipp.launch", *map(str, args)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Wait for a launch (killing it if it hangs) and return its exit code and output."""
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return proc.returncode, out, err


def log_paths(stderr: str, rank: int) -> list[tuple[Path, Path]]:
    """The (stdout, stderr) log files the launcher said `rank` writes to, one pair per attempt."""
    return [(Path(o), Path(e)) for o, e in re.findall(rf"rank {rank}: (\S+) (\S+)", stderr)]


@pytest.mark.parametrize("spec, count, expected", [
    ("3,1", 4, [3, 1]), ("3,2,1,0", 4, [3, 2, 1, 0]), ("1,2,3", 4, [1, 2, 3]), ("0,3", 4, [0, 3]),
    ("0", 1, [0]), ("all", 3, [0, 1, 2])])
def test_parse_gpus_keeps_the_order_given(spec, count, expected):
    assert parse_gpus(spec, device_count=count) == expected


@pytest.mark.parametrize("spec, count, message", [
    ("0,0", 4, "GPU 0 listed twice; give each GPU once, e.g. --gpus 0,1"),
    ("1,2,1", 4, "GPU 1 listed twice"),
    ("x", 4, "'x' is not a GPU index"), ("0,,1", 4, "'' is not a GPU index"), ("", 4, "'' is not a GPU index"),
    ("-1", 4, "'-1' is not a GPU index"), ("1.5", 4, "'1.5' is not a GPU index"),
    ("9", 4, "GPU 9 does not exist; this host has 4 GPUs (0-3)"),
    ("0,1", 1, "GPU 1 does not exist; this host has 1 GPU (0-0)"),
    ("0", 0, "this host has no GPU; use --nproc N"), ("all", 0, "this host has no GPU; use --nproc N")])
def test_parse_gpus_names_what_is_wrong(spec, count, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_gpus(spec, device_count=count)


BAD_INPUT = {  # arguments -> what the one-line error must say (this host has no GPU)
    ("--gpus", "0,0", ECHO): "--gpus 0,0: GPU 0 listed twice; give each GPU once, e.g. --gpus 0,1",
    ("--gpus", "x", ECHO): "--gpus x: 'x' is not a GPU index",
    ("--gpus", "9", ECHO): "--gpus 9: this host has no GPU; use --nproc N",
    ("--gpus", "all", ECHO): "--gpus all: this host has no GPU; use --nproc N",
    (ECHO,): "no GPU on this host; pass --nproc N",
    ("--nproc", "0", ECHO): "argument --nproc: '0' is not a whole number >= 1",
    ("--gpus", "0", "--nproc", "2", ECHO): "argument --nproc: not allowed with argument --gpus",
    ("--nproc", "2", "missing.py"): "script 'missing.py' not found",
    ("--nproc", "1", "--nnodes", "2", ECHO): "--nnodes 2 needs --master-addr HOST",
    ("--nproc", "1", "--node-rank", "1", ECHO): "--node-rank 1: must be below --nnodes 1",
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every bad command line, run at once."""
    out = tmp_path_factory.mktemp("bad")
    start = time.monotonic()
    procs = {args: launch(*args, out) for args in BAD_INPUT}
    return {args: (*finish(proc), time.monotonic() - start) for args, proc in procs.items()}, out


@pytest.mark.parametrize("args", BAD_INPUT, ids=lambda args: " ".join(map(str, args)).replace(str(ECHO), "echo.py"))
def test_bad_input_fails_at_once_with_one_line(bad_input_runs, args):
    runs, out = bad_input_runs
    rc, stdout, stderr, seconds = runs[args]
    assert rc == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith(f"{PROG}: error: {BAD_INPUT[args]}"), stderr
    assert not list(out.iterdir()), "no worker may start"
    assert seconds < 30  # no fastai import, no worker: seconds at most, even with 10 launchers on 2 cores


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory):
    """Two --nproc 2 launches of the echo worker running at the same time on this host."""
    dirs = [tmp_path_factory.mktemp(f"run{i}") for i in range(2)]
    procs = [launch("--nproc", 2, ECHO, d, "--epochs", 4, "--nproc", 7) for d in dirs]
    return [(*finish(proc), d) for proc, d in zip(procs, dirs)]


def test_two_launches_at_once_both_succeed(two_launches):
    for rc, _, stderr, _ in two_launches:
        assert rc == 0, stderr[-3000:]
    ports = {json.loads((d / "rank0.json").read_text())["MASTER_PORT"] for *_, d in two_launches}
    assert len(ports) == 2


def test_every_rank_gets_its_env_and_the_script_args(two_launches):
    _, _, _, out = two_launches[0]
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen == dict(seen, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", DDIPP_DEVICES="cpu",
                            OMP_NUM_THREADS="1", args=["--epochs", "4", "--nproc", "7"], sum_of_ranks_plus_one=3)


def test_only_rank0_prints_and_the_others_log_to_the_printed_files(two_launches):
    _, stdout, stderr, _ = two_launches[0]
    assert "stdout of rank 0" in stdout and "stdout of rank 1" not in stdout
    assert "stderr of rank 0" in stderr and "stderr of rank 1" not in stderr
    assert len(re.findall("only rank 0 prints here", stderr)) == 1
    [(out_log, err_log)] = log_paths(stderr, 1)
    assert "stdout of rank 1" in out_log.read_text()
    assert "stderr of rank 1" in err_log.read_text()


def test_a_failing_rank_ends_the_launch_shows_its_traceback_and_leaves_no_process():
    start = time.monotonic()
    rc, stdout, stderr = finish(launch("--nproc", 2, "--max-restarts", 1, FAIL))
    assert rc == 1 and time.monotonic() - start < 120
    assert stdout.count("rank 0 waits for rank 1, forever") == 2  # blocked, then stopped, in each attempt
    assert "rank 0 stopped (SIGTERM)" in stderr
    assert "rank 1 failed (exit code 1); end of" in stderr
    assert stderr.rstrip().endswith("RuntimeError: rank 1 gives up on purpose")
    attempts = log_paths(stderr, 1)
    assert [p.parent.parent.name for p, _ in attempts] == ["attempt_0", "attempt_1"]  # --max-restarts 1: twice
    assert all("rank 1 gives up on purpose" in err.read_text() for _, err in attempts)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(FAIL) in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_two_nodes_form_one_group(tmp_path):
    with socket.socket() as s:  # a free port for node 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [launch("--nnodes", 2, "--node-rank", node, "--master-addr", "127.0.0.1", "--master-port", port,
                    "--nproc", 1, ECHO, tmp_path) for node in range(2)]
    (rc0, out0, err0), (rc1, out1, err1) = map(finish, procs)
    assert rc0 == rc1 == 0, err0[-3000:] + err1[-3000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["LOCAL_RANK"], seen["WORLD_SIZE"], seen["sum_of_ranks_plus_one"]) == ("0", "2", 3)
    assert "stdout of rank 0" in out0 and out1 == ""  # node 1's only rank is not rank 0: it logs to a file
    [(out_log, _)] = log_paths(err1, 1)
    assert "stdout of rank 1" in out_log.read_text()
