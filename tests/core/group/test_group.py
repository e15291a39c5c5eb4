"""The notebook's worker group (ddipp.core.group) with plain torch: 2 CPU ranks in gloo, fits given by the plain-torch
fitting module tests/core/workers/torch_fitting.py. A rank that raises, dies or hangs must surface here within seconds,
naming its rank; the workers stay if every rank lives, else none is left behind; nothing listens beyond loopback."""
import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import psutil
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ddipp.core.group.group import START_TIMEOUT, WorkerError, WorkerGroup, _groups, group_for, shutdown
from ddipp.core.group.wire import pickled_data
from ddipp.core.options import Options
from ddipp.core.store import loopback_listener, loopback_store

CPU2 = ("cpu", "cpu")
FITTING = "torch_fitting"  # tests/core/workers/torch_fitting.py


@pytest.fixture(autouse=True)
def no_group_left():
    yield
    shutdown()


def fit(group, call) -> object:
    """Run `call(data, device)` on every rank of `group`; rank 0's result."""
    calls = [cloudpickle.dumps(call)] * len(group.devices)  # each rank's request: the same
    results, interrupted = group.fit(pickled_data(torch.arange(4.0), "data"), calls, Options(), None)
    assert not interrupted
    return cloudpickle.loads(results[0])


def summed(data, device):
    """Every rank's rank + 1 and its data, all-reduced."""
    total = data + dist.get_rank() + 1
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total


def fail_on_rank1(data, device):
    """One all-reduce, then rank 1 raises while rank 0 waits in the next one."""
    summed(data, device)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return summed(data, device)


def die_on_rank1(data, device):
    """Rank 1 dies while its DataLoader's worker process runs, which holds copies of its sockets."""
    summed(data, device)
    if dist.get_rank() == 1:
        batches = iter(DataLoader(data, num_workers=1))
        next(batches)
        os.kill(os.getpid(), signal.SIGKILL)
    return summed(data, device)


def stall_rank1(data, device):
    """Rank 1 stops taking part (stuck outside torch), so rank 0 waits in the next all-reduce."""
    summed(data, device)
    if dist.get_rank() == 1:
        threading.Event().wait()
    return summed(data, device)


def _failing_fit(group, call, error):
    """The error a fit of `call` raised here, and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(error) as raised:
        fit(group, call)
    return raised.value, time.monotonic() - started


def _no_workers_left() -> bool:
    return not psutil.Process().children(recursive=True)


@pytest.mark.slow  # starts a worker group
def test_a_fit_runs_on_every_rank_in_one_process_group_and_rank0s_result_comes_back():
    rank, world, total = fit(group_for(CPU2, 60, FITTING), summed)
    assert (rank, world) == (0, 2) and torch.equal(total, 2 * torch.arange(4.0) + 3)


@pytest.mark.slow  # starts a worker group
def test_an_exception_on_one_rank_raises_here_with_its_type_rank_and_traceback():
    group = group_for(CPU2, 60, FITTING)
    workers = [p.pid for p in group.procs]
    error, took = _failing_fit(group, fail_on_rank1, ValueError)
    assert str(error) == "rank 1 fails on purpose" and took < 10
    assert "raised on rank 1" in error.__notes__[0]
    assert "in fail_on_rank1" in str(error.__cause__)
    assert fit(group, summed)[1] == 2  # on the same workers, in a new process group
    assert [p.pid for p in _groups[CPU2].procs] == workers


@pytest.mark.slow  # starts a worker group
def test_a_rank_that_dies_raises_a_worker_error_naming_it_and_the_next_fit_runs_on_a_new_group():
    """At once, though its loader's worker lived on (torch's watchdog there ends it 5 s later): it dies with the
    rank."""
    group = group_for(CPU2, 60, FITTING)
    group.wait_ready()
    error, took = _failing_fit(group, die_on_rank1, WorkerError)
    assert "rank 1" in str(error) and "killed by SIGKILL" in str(error) and took < 3, took
    assert _no_workers_left() and CPU2 not in _groups
    assert fit(group_for(CPU2, 60, FITTING), summed)[1] == 2


@pytest.mark.slow  # starts a worker group
def test_a_hung_collective_fails_after_the_timeout():
    error, took = _failing_fit(group_for(CPU2, 5, FITTING), stall_rank1, RuntimeError)
    assert "raised on rank 0" in error.__notes__[0] and 5 <= took < 20, (error, took)
    assert _no_workers_left()  # rank 1 never ended its fit


@pytest.mark.slow  # starts a worker group
def test_nothing_of_a_group_listens_beyond_loopback():
    group = group_for(CPU2, 60, FITTING)
    fit(group, summed)
    me = psutil.Process()
    listening = {p.pid: _listening(p) for p in [me, *me.children(recursive=True)]}
    assert [port for _, port in listening[me.pid]] == [group.store.port]  # the store, for the group's life
    assert all(len(addresses) >= 1 for pid, addresses in listening.items() if pid != me.pid)  # gloo's listeners
    for pid, addresses in listening.items():
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in addresses), (pid, addresses)
    _refused_from_outside([port for addresses in listening.values() for _, port in addresses])


def test_the_rendezvous_store_listens_on_loopback_only():
    before = _listening(psutil.Process())
    store = loopback_store(loopback_listener(), timedelta(seconds=10))
    [(ip, port)] = [address for address in _listening(psutil.Process()) if address not in before]
    assert ipaddress.ip_address(ip).is_loopback and port == store.port
    _refused_from_outside([port])
    del store
    assert _listening(psutil.Process()) == before


def _listening(proc: psutil.Process) -> list:
    """(address, port) of every TCP socket `proc` listens on."""
    return [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _refused_from_outside(ports: list) -> None:
    """Connecting to `ports` through this host's non-loopback address fails (skips if it has none)."""
    outside = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
               if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    if not outside:
        pytest.skip("this host has no non-loopback IPv4 address")
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((outside[0], port), timeout=5).close()


@pytest.mark.slow  # starts a worker group
def test_workers_start_in_the_background_and_the_first_fit_waits_for_them(tmp_path, monkeypatch, capsys):
    """The group returns while its workers start (to_ddp's cell returns at once); a fit waits for them, then runs."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("DDIPP_TEST_GATE", str(gate))
    monkeypatch.setattr("ddipp.core.group.group.START_TIMEOUT", 30)  # waiting for the workers here fails in 30 s
    group = group_for(CPU2, 60, "gated_fitting")  # tests/core/workers/gated_fitting.py: ready once `gate` exists
    assert group.alive and not group.ready
    gate.touch()
    rank, world, total = fit(group, summed)
    assert (rank, world, total.tolist()) == (0, 2, [3.0, 5.0, 7.0, 9.0])
    out = capsys.readouterr().out
    assert "in the background (the first fit waits for them)" in out and "ddipp: workers ready in" in out


@pytest.mark.slow  # starts a worker group
def test_a_first_fit_long_after_the_workers_started_finds_them_ready():
    """A fit called past START_TIMEOUT after to_ddp reads the workers' ready, sent long before, as on time."""
    group = group_for(CPU2, 60, FITTING)
    for conn in group.conns:
        wait([conn])  # its ready waits to be read
    group.started -= 2 * START_TIMEOUT  # as if to_ddp had been called 10 minutes ago
    assert fit(group, summed)[1] == 2


@pytest.mark.slow  # starts a worker group
def test_a_group_no_learner_uses_stops_when_another_needs_its_devices():
    dropped = group_for(CPU2, 60, FITTING)  # no learner is bound to it
    single = group_for(("cpu",), 60, FITTING)
    assert not dropped.procs and CPU2 not in _groups and len(single.procs) == 1


@pytest.mark.slow  # starts a worker group
def test_shutdown_stops_every_group_and_removes_their_logs():
    logs = group_for(CPU2, 60, FITTING).logs
    assert logs.parent == Path(tempfile.gettempdir()) and logs.is_dir()
    shutdown()
    assert not _groups and _no_workers_left() and not logs.exists()


@pytest.mark.slow  # starts a worker group
def test_a_notebook_killed_while_its_workers_start_leaves_none():
    """Killed between starting its workers and their joining, the notebook leaves them waiting for its store, the
    wait holding the GIL: its Python watcher never ran, and they stayed for the collective timeout (600 s)."""
    notebook = f"from ddipp.core.group.group import group_for; group_for({CPU2!r}, 600, {FITTING!r})"
    proc = subprocess.Popen([sys.executable, "-c", notebook], stdout=subprocess.DEVNULL)
    workers = []
    try:
        while len(workers) < 2 and proc.poll() is None:
            workers = psutil.Process(proc.pid).children()  # polling the process table, not synchronising with it
            time.sleep(0.02)  # without spinning a core the notebook starts on
        proc.kill()
        proc.wait()
        assert len(workers) == 2
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert alive == []
    finally:
        proc.kill()
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()


def test_a_dead_workers_log_of_blank_lines_reads_as_nothing_printed(tmp_path):
    """'its output ended with:' was followed by nothing when the log held only blank lines."""
    group = SimpleNamespace(logs=tmp_path)
    (tmp_path / "rank1.log").write_text("\n\n  \n")
    assert WorkerGroup._log_tail(group, 1) == "it printed nothing"
    (tmp_path / "rank1.log").write_text("\nKilled\n\n")
    assert WorkerGroup._log_tail(group, 1) == "its output ended with:\nKilled"


def test_a_group_interrupted_as_it_starts_leaves_no_logs_folder(monkeypatch):
    """Interrupted before its workers started (a restart's group, stopped at 'ddipp: restart 1 of 1'), the group's logs
    folder stayed in the temp folder after the kernel ended: nothing knew the group."""
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr("ddipp.core.group.group.loopback_listener", interrupted)
    before = set(Path(tempfile.gettempdir()).glob(f"ddipp-workers-{os.getpid()}-*"))
    with pytest.raises(KeyboardInterrupt):
        group_for(CPU2, 60, FITTING)
    assert set(Path(tempfile.gettempdir()).glob(f"ddipp-workers-{os.getpid()}-*")) == before and CPU2 not in _groups
