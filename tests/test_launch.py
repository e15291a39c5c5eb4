"""python -m ddipp.launch: the --gpus mapping, the launch configuration and the workers' environment, one-line errors
for bad input, and real CPU launches: what listens where, what stays in the temp folder."""
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ddipp.core.dist import parse_gpus
from ddipp.launch import PROG, Config, _report, config_from_args, parse, store_socket

WORKERS = Path(__file__).parent / "workers"
ECHO, FAIL, RESTART, PEER_FAIL, EXIT, TEARDOWN = (WORKERS / name for name in (
    "launch_echo.py", "launch_fail.py", "launch_restart.py", "launch_peer_fail.py", "launch_exit.py",
    "launch_teardown.py"))
# fastai's import warns about pkg_resources in every launcher; pytest.ini ignores it the same way
ENV = dict(os.environ, PYTHONWARNINGS="ignore:pkg_resources is deprecated:UserWarning")
ENV.pop("OMP_NUM_THREADS", None)  # the launcher must set it itself


def launch(*args: str, tmp: Path | None = None) -> subprocess.Popen:
    """Start `python -m ddipp.launch ARGS` with its output captured (and `tmp` as its temp folder)."""
    env = dict(ENV, TMPDIR=str(tmp)) if tmp else ENV
    return subprocess.Popen([sys.executable, "-m", "ddipp.launch", *map(str, args)], env=env, text=True,
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


def listening(pid: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every LISTEN socket of process `pid` and of its descendants."""
    root = psutil.Process(pid)
    return [(p.pid, c.laddr.ip, c.laddr.port) for p in [root, *root.children(recursive=True)]
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def outside_address() -> str | None:
    """An address of this host that other machines could reach (not loopback or link-local), or None."""
    for addr in (a for addrs in psutil.net_if_addrs().values() for a in addrs):
        if addr.family in (socket.AF_INET, socket.AF_INET6):
            ip = ipaddress.ip_address(addr.address.split("%")[0])
            if not (ip.is_loopback or ip.is_link_local):
                return str(ip)
    return None


def connect(address: str, port: int) -> str:
    """How a TCP connection to address:port ends: "refused", or "accepted" (then closed at once)."""
    try:
        socket.create_connection((address, port), timeout=10).close()
    except ConnectionRefusedError:
        return "refused"
    return "accepted"


def wait_for(paths: list[Path], procs: list[subprocess.Popen], seconds: float = 240) -> bool:
    """Wait until every path exists: True; False if a launch ends first, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while not all(path.exists() for path in paths):
        if any(proc.poll() is not None for proc in procs) or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_one_host_listens_on_loopback_and_keeps_the_workers_there(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # 2 cores: a thread per process
    config = config_from_args(parse(["--nproc", "2", str(ECHO), "--epochs", "4"]), environ={})
    assert config == Config(script=str(ECHO), script_args=["--epochs", "4"], nproc=2, nnodes=1, node_rank=0,
                            master_addr="127.0.0.1", master_port=0, max_restarts=0,
                            env={"DDIPP_DEVICES": "cpu", "DDIPP_TIMEOUT": "600", "OMP_NUM_THREADS": "1",
                                 "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"})
    with store_socket(config) as first, store_socket(config) as second:  # two launches at once
        assert first.getsockname()[0] == second.getsockname()[0] == "127.0.0.1"
        assert first.getsockname()[1] != second.getsockname()[1]


@pytest.mark.parametrize("cores, nproc, threads", [(16, 8, "2"), (16, 3, "5"), (2, 4, "1")])
def test_each_process_gets_its_share_of_the_hosts_cores_as_threads(monkeypatch, cores, nproc, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    config = config_from_args(parse(["--nproc", str(nproc), str(ECHO)]), environ={})
    assert config.env["OMP_NUM_THREADS"] == threads


def test_the_users_own_settings_win():
    args = parse(["--nproc", "2", "--timeout", "42.5", "--master-port", "29600", str(ECHO)])
    config = config_from_args(args, environ={"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "4"})
    assert (config.master_addr, config.master_port) == ("127.0.0.1", 29600)
    assert config.env == {"DDIPP_DEVICES": "cpu", "DDIPP_TIMEOUT": "42.5", "NCCL_SOCKET_IFNAME": "=lo"}


def test_several_hosts_meet_at_the_master_address_on_the_hosts_interfaces():
    args = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", "--nproc", "1", str(ECHO)])
    config = config_from_args(args, environ={})
    assert (config.master_addr, config.master_port, config.nnodes, config.node_rank) == ("node0", 29500, 2, 1)
    assert config.env == {"DDIPP_DEVICES": "cpu", "DDIPP_TIMEOUT": "600"}
    assert store_socket(config) is None  # node rank 0's store listens elsewhere


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
    ("--nproc", "1", "--master-addr", "10.0.0.1", ECHO): "--master-addr 10.0.0.1: only for --nnodes > 1; one host",
    ("--nproc", "1", "--timeout", "0", ECHO): "argument --timeout: '0' is not a number of seconds > 0, e.g. --timeout",
    ("--nproc", "1", "--timeout", "-5", ECHO): "argument --timeout: '-5' is not a number of seconds > 0",
    ("--nproc", "1", "--timeout", "soon", ECHO): "argument --timeout: 'soon' is not a number of seconds > 0",
    ("--nproc", "1", "--timeout", "inf", ECHO): "argument --timeout: 'inf' is not a number of seconds > 0",
    ("--nproc", "1", "--timeout", "nan", ECHO): "argument --timeout: 'nan' is not a number of seconds > 0",
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every bad command line, run at once."""
    out = tmp_path_factory.mktemp("bad")
    start = time.monotonic()
    procs = {args: launch(*args, out) for args in BAD_INPUT}
    return {args: (*finish(proc), time.monotonic() - start) for args, proc in procs.items()}, out


@pytest.mark.slow
@pytest.mark.parametrize("args", BAD_INPUT, ids=lambda args: " ".join(map(str, args)).replace(str(ECHO), "echo.py"))
def test_bad_input_fails_at_once_with_one_line(bad_input_runs, args):
    runs, out = bad_input_runs
    rc, stdout, stderr, seconds = runs[args]
    assert rc == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith(f"{PROG}: error: {BAD_INPUT[args]}"), stderr
    assert not list(out.iterdir()), "no worker may start"
    assert seconds < 60  # no fastai import, no worker: 16 launchers (4 load torch for the GPU count) on 2 busy cores



@pytest.mark.slow
def test_a_master_port_in_use_is_refused_before_any_worker_starts(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(), tmp.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        procs = {"127.0.0.1": launch("--nproc", 2, "--master-port", port, ECHO, out, tmp=tmp),  # one host
                 "*": launch("--nnodes", 2, "--master-addr", "127.0.0.1", "--master-port", port, "--nproc", 1, ECHO,
                             out, tmp=tmp)}  # node rank 0 of two
        runs = {where: finish(proc) for where, proc in procs.items()}
    for where, (rc, stdout, stderr) in runs.items():
        assert rc == 2 and stdout == "" and stderr.count("\n") == 1, stderr
        assert stderr.startswith(f"{PROG}: error: --master-port {port}: cannot listen on {where}:{port} "
                                 "(Address already in use); pick another port, or leave --master-port out")
    assert not list(out.iterdir()) and not list(tmp.iterdir()), "no worker may start, no log folder be made"


@dataclass
class HeldLaunch:
    """A launch of the echo worker: what it looked like while its workers held the group, and how it ended."""

    out: Path  # the echo worker's folder
    tmp: Path  # the launcher's temp folder
    listening: list[tuple[int, str, int]]  # (pid, address, port) of the launcher's and the workers' LISTEN sockets
    store_port: int
    connections: dict[str, str]  # address -> how a connection to the store's port there ended
    files: dict[Path, str]  # the temp folder's files and what they held
    rc: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory):
    """Two --nproc 2 launches of the echo worker running at the same time on this host, each with its own temp folder,
    the first with --timeout 42.5; both looked at while their workers hold the group, then let finish."""
    dirs = [(tmp_path_factory.mktemp(f"run{i}"), tmp_path_factory.mktemp(f"tmp{i}")) for i in range(2)]
    for out, _ in dirs:
        (out / "hold").touch()
    procs = [launch("--nproc", 2, *timeout, ECHO, out, "--epochs", 4, "--nproc", 7, tmp=tmp)
             for (out, tmp), timeout in zip(dirs, [("--timeout", "42.5"), ()])]
    formed = wait_for([out / f"rank{rank}.json" for out, _ in dirs for rank in range(2)], procs)
    seen = [held(proc, out, tmp) for proc, (out, tmp) in zip(procs, dirs)] if formed else []
    for out, _ in dirs:
        (out / "hold").unlink()
    ended = [finish(proc) for proc in procs]
    if not formed:
        pytest.fail("the groups did not form:\n" + "\n".join(stderr[-3000:] for _, _, stderr in ended))
    return [HeldLaunch(*looks, *end) for looks, end in zip(seen, ended)]


def held(proc: subprocess.Popen, out: Path, tmp: Path) -> tuple:
    """What a launch whose workers hold their group looks like: HeldLaunch's fields up to `files`."""
    port = int(json.loads((out / "rank0.json").read_text())["MASTER_PORT"])
    addresses = ["127.0.0.1", *filter(None, [outside_address()])]
    return (out, tmp, listening(proc.pid), port, {address: connect(address, port) for address in addresses},
            {path: path.read_text() for path in tmp.rglob("*") if path.is_file()})


@pytest.mark.slow
def test_two_launches_at_once_both_succeed(two_launches):
    for run in two_launches:
        assert run.rc == 0, run.stderr[-3000:]
    assert len({run.store_port for run in two_launches}) == 2


@pytest.mark.slow
def test_every_rank_gets_its_env_and_the_script_args(two_launches):
    for run, timeout in zip(two_launches, ["42.5", "600"]):
        for rank in range(2):
            seen = json.loads((run.out / f"rank{rank}.json").read_text())
            assert seen == dict(seen, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", DDIPP_DEVICES="cpu",
                                DDIPP_TIMEOUT=timeout, OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // 2)),
                                MASTER_ADDR="127.0.0.1",
                                GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="=lo",
                                args=["--epochs", "4", "--nproc", "7"], sum_of_ranks_plus_one=3)


@pytest.mark.slow
def test_nothing_of_a_one_host_launch_listens_beyond_loopback(two_launches):
    for run in two_launches:
        pids = {pid for pid, _, _ in run.listening}
        assert len(pids) == 3 and run.store_port in {port for _, _, port in run.listening}  # launcher, 2 workers
        beyond = [(pid, address, port) for pid, address, port in run.listening
                  if not ipaddress.ip_address(address).is_loopback]
        assert beyond == []


@pytest.mark.slow
def test_the_store_is_not_reachable_from_the_network(two_launches):
    for run in two_launches:
        assert run.connections.pop("127.0.0.1") == "accepted"
        if not run.connections:
            pytest.skip("this host has no address beyond loopback")
        assert set(run.connections.values()) == {"refused"}, run.connections


@pytest.mark.slow
def test_only_rank0_prints_and_the_others_log_to_the_printed_files(two_launches):
    run = two_launches[0]
    assert "stdout of rank 0" in run.stdout and "stdout of rank 1" not in run.stdout
    assert "stderr of rank 0" in run.stderr and "stderr of rank 1" not in run.stderr
    assert len(re.findall("only rank 0 prints here", run.stderr)) == 1
    share = max(1, len(os.sched_getaffinity(0)) // 2)  # said once, before the ranks start
    assert run.stderr.count(f"2 processes share {len(os.sched_getaffinity(0))} cores: OMP_NUM_THREADS={share} each, "
                            f"and num_workers={share} for a fastai loader left at fastai's default") == 1
    [(out_log, err_log)] = log_paths(run.stderr, 1)
    assert "stdout of rank 1" in run.files[out_log]  # read while the group ran: a successful run's logs go
    assert "stderr of rank 1" in run.files[err_log]


@pytest.mark.slow
def test_a_successful_launch_leaves_nothing_in_the_temp_folder(two_launches):
    for run in two_launches:
        assert run.files and all(path.is_relative_to(run.tmp) for path in run.files)  # logs while it ran
        assert not list(run.tmp.iterdir())


@pytest.mark.slow
def test_a_failing_rank_ends_the_launch_shows_its_traceback_and_keeps_the_logs(tmp_path):
    start = time.monotonic()
    rc, stdout, stderr = finish(launch("--nproc", 2, "--max-restarts", 1, FAIL, tmp=tmp_path))
    assert rc == 1 and time.monotonic() - start < 120
    assert stdout.count("rank 0 waits for rank 1, forever") == 2  # blocked, then stopped, in each attempt
    assert "rank 1 failed (exit code 1); end of" in stderr
    # rank 0, stopped by elastic, is said last where torch's elastic reports it (2.14 does, 2.8 does not)
    assert stderr.rstrip().removesuffix(f"\n{PROG}: rank 0 stopped (SIGTERM)").endswith(
        "RuntimeError: rank 1 gives up on purpose"), stderr[-2000:]
    attempts = log_paths(stderr, 1)
    assert [p.parent.parent.name for p, _ in attempts] == ["attempt_0", "attempt_1"]  # --max-restarts 1: twice
    assert all("rank 1 gives up on purpose" in err.read_text() for _, err in attempts)
    [folder] = tmp_path.iterdir()  # the logs stay, in the one folder the launch made
    assert folder.name.startswith("torchelastic_") and all(err.is_relative_to(folder) for _, err in attempts)
    assert f"end of {attempts[-1][1]}:" in stderr
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(FAIL) in " ".join(p.info["cmdline"] or [])]
    assert left == []


@pytest.mark.slow
def test_the_failing_ranks_error_comes_first_and_the_rank_it_stopped_says_so_in_one_line(tmp_path):
    rc, stdout, stderr = finish(launch("--nproc", 2, PEER_FAIL, tmp=tmp_path))
    assert rc == 1
    lines = stderr.splitlines()
    error = lines.index("[rank1]: ValueError: rank 1 fails on purpose")  # the end of rank 1's log, shown
    rank0 = [i for i, line in enumerate(lines) if line.startswith((f"{PROG}: rank 0", "[rank0]"))]
    # rank 0, stopped by rank 1's failure: one line, after it; none where elastic stopped it first and does not
    # report a rank it stopped (torch 2.8; 2.14 reports it)
    assert rank0 in ([], [error + 1]), stderr
    assert rank0 == [] or lines[error + 1] in (
        f"{PROG}: rank 0 stopped because rank 1 failed (ValueError: rank 1 fails on purpose)",
        f"{PROG}: rank 0 stopped (SIGTERM)"), stderr  # the launcher may stop it first
    assert [line for line in stdout.splitlines() + lines if "Traceback" in line] == ["[rank1]: Traceback (most recent "
                                                                                      "call last):"]


@pytest.mark.slow
def test_a_rank_that_raised_and_was_still_exiting_when_the_rank_it_stopped_ended_is_reported_first(tmp_path):
    # elastic reports only the ranks that ended before it stopped the group: here rank 0 alone
    rc, _, stderr = finish(launch("--nproc", 2, PEER_FAIL, "stuck-exiting", tmp=tmp_path))
    assert rc == 1
    lines = stderr.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith(f"{PROG}: rank ")]
    assert [lines[i] for i in said][-1] == (f"{PROG}: rank 0 stopped because rank 1 failed (ValueError: rank 1 fails "
                                            "on purpose)"), stderr
    assert lines[said[0]].startswith(f"{PROG}: rank 1 raised and was stopped (SIGTERM) while it exited; end of"), stderr
    assert lines.index("[rank1]: ValueError: rank 1 fails on purpose") < said[-1]


@pytest.mark.slow
def test_a_rank_that_exits_with_a_status_makes_the_launcher_exit_with_it(tmp_path):
    rc, _, stderr = finish(launch("--nproc", 2, EXIT, 3, tmp=tmp_path))
    assert rc == 3, stderr[-3000:]  # rank 0, stopped by the launcher (SIGTERM), does not count
    assert "rank 1 failed (exit code 3)" in stderr


@pytest.mark.slow
def test_ranks_that_finished_exit_0_with_their_results_whatever_their_interpreters_exit_does(tmp_path):
    # a gloo group still there when the interpreter ends aborts a finished rank (SIGABRT) in about half the launches on
    # this stack; each launch's script made its group itself before ddipp joined it
    for launch_number in range(3):
        out = tmp_path / f"sum{launch_number}"
        rc, _, stderr = finish(launch("--nproc", 2, TEARDOWN, out, tmp=tmp_path))
        exits = [(tmp_path / f"{out.name}.rank{rank}").read_text() for rank in range(2)]
        assert (rc, out.read_text(), exits) == (0, "3", ["left"] * 2), f"launch {launch_number}: {stderr[-3000:]}"


def _failure(tmp: Path, rank: int, exitcode: int, how: str = ""):
    """Elastic's record of a failed rank: exited `exitcode` (< 0: stopped by that signal), having raised (`how`
    "raised": its log ends with a traceback) or been stopped by a peer's failure ("peer": ddipp's error file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    file = tmp / f"error{rank}.json"
    if how == "peer":
        file.write_text(json.dumps({"ddipp_peer_failure": True, "message": {
            "message": f"rank {rank} stopped because another rank failed", "extraInfo": {"timestamp": "0"}}}))
    (tmp / f"log{rank}").write_text("[rank{rank}]: Traceback (most recent call last):\n" if how == "raised" else "")
    return ProcessFailure(rank, 10 + rank, exitcode, str(file))


@pytest.mark.parametrize("ended, status", [
    ([(3,), (-signal.SIGTERM,)], 3),  # rank 1 stopped by the launcher
    ([(3,), (3,)], 3),
    ([(1, "peer"), (3,)], 3),  # rank 0 stopped by rank 1's failure (ddipp's peer failure)
    ([(3,), (4,)], 1),
    ([(3,), (-signal.SIGKILL,)], 1),
    ([(3,), (-signal.SIGTERM, "raised")], 1),  # rank 1 raised (Python's 1) and was stopped while it exited
    ([(-signal.SIGTERM,), (-signal.SIGTERM,)], 1),
], ids=str)
def test_the_launcher_exits_with_the_status_every_rank_that_failed_on_its_own_exited_with(tmp_path, capsys, ended,
                                                                                         status):
    failures = {rank: _failure(tmp_path, rank, *end) for rank, end in enumerate(ended)}
    assert _report(failures, {rank: str(tmp_path / f"log{rank}") for rank in failures}) == status


@pytest.mark.slow
def test_a_restarted_group_forms_and_one_that_cannot_fails_within_the_timeout_naming_the_absent_rank(tmp_path):
    rc, stdout, stderr = finish(launch("--nproc", 2, "--max-restarts", 2, "--timeout", 15, RESTART, tmp=tmp_path))
    assert rc == 0, stderr[-3000:]  # attempt 2 ended well on both ranks
    assert "attempt 0: rank 0 of 2 sums 3" in stdout  # then rank 1 killed itself
    assert "ddipp: the group of attempt 1 did not form within 15 s: rank 1 never came to join it" in stderr
    [waited] = re.findall(r"attempt 1: rank 0 waited ([\d.]+) s to join", stdout)
    assert float(waited) < 15 + 10
    assert "attempt 2: rank 0 of 2 sums 3" in stdout  # 1 + 2: rank 1 joined the restarted group


def test_a_rank_stopped_while_it_exited_after_raising_is_reported_with_its_traceback(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    log = tmp_path / "stderr.log"  # as elastic writes it: every line prefixed with the rank
    log.write_text("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: rank 1 fails on purpose\n")
    quiet = tmp_path / "quiet.log"
    quiet.write_text("[rank2]: waiting\n")
    _report({1: ProcessFailure(1, 11, -15, ""), 2: ProcessFailure(2, 12, -15, "")}, {1: str(log), 2: str(quiet)})
    err = capsys.readouterr().err
    assert f"rank 1 raised and was stopped (SIGTERM) while it exited; end of {log}:" in err
    assert "[rank1]: ValueError: rank 1 fails on purpose" in err
    assert err.rstrip().endswith("rank 2 stopped (SIGTERM)")  # one that did not raise: no log to read


def test_a_rank_stopped_before_its_traceback_is_printed_is_reported_first_with_its_error_file(tmp_path, monkeypatch,
                                                                                              capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddipp.core import dist
    files = {rank: tmp_path / f"error{rank}.json" for rank in range(2)}
    for rank, (error, peer) in enumerate([(RuntimeError("Connection closed by peer"), True),
                                          (ValueError("rank 1 fails on purpose"), False)]):
        monkeypatch.setenv(dist.ERROR_FILE_ENV, str(files[rank]))
        try:
            raise error
        except Exception as e:
            dist._tell_launcher(e, "rank 0 stopped because rank 1 failed" if peer else str(e), peer_failure=peer)
    log = tmp_path / "stderr.log"
    log.write_text("[rank1]: (its traceback never came)\n")
    _report({rank: ProcessFailure(rank, 10 + rank, [1, -15][rank], str(files[rank])) for rank in range(2)},
            {0: "", 1: str(log)})
    said = capsys.readouterr().err.splitlines()
    assert said[0] == f"{PROG}: rank 1 raised and was stopped (SIGTERM) while it exited; its error, from {files[1]}:"
    assert said[1] == "Traceback (most recent call last):" and said[-2:] == [
        "ValueError: rank 1 fails on purpose", f"{PROG}: rank 0 stopped because rank 1 failed"], said


@pytest.mark.slow
def test_two_nodes_form_one_group(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir(), tmp.mkdir()
    with socket.socket() as s:  # a free port for node 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [launch("--nnodes", 2, "--node-rank", node, "--master-addr", "127.0.0.1", "--master-port", port,
                    "--nproc", 1, ECHO, out, tmp=tmp) for node in range(2)]
    (rc0, out0, err0), (rc1, out1, err1) = map(finish, procs)
    assert rc0 == rc1 == 0, err0[-3000:] + err1[-3000:]
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert (seen["LOCAL_RANK"], seen["WORLD_SIZE"], seen["sum_of_ranks_plus_one"]) == ("0", "2", 3)
        assert (seen["MASTER_PORT"], seen["GLOO_SOCKET_IFNAME"]) == (str(port), None)  # gloo where the hosts meet
    assert "stdout of rank 0" in out0 and out1 == ""  # node 1's only rank is not rank 0: it logs to a file
    [(out_log, _)] = log_paths(err1, 1)
    assert out_log.is_relative_to(tmp) and not list(tmp.iterdir())  # removed: both nodes succeeded
