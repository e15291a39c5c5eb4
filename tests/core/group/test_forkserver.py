"""A kernel's fork server (ddipp.core.group.forkserver): the worker group forks its workers from it, started as this
test process's, with the plain-torch fitting module: they fit as spawned workers do, start at once once the server
imported what they need, report their deaths with their signal, and leave nothing behind, however they end; a server
that ended leaves the group to spawn its workers."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from ddipp.core.group import binding, forkserver
from ddipp.core.group.group import SpawnedWorker, WorkerError, _groups, group_for, shutdown
from ddipp.core.group.wire import pickled_data
from ddipp.core.options import Options
from test_group import fit, summed

CPU2 = ("cpu", "cpu")
FITTING = "torch_fitting"  # tests/core/workers/torch_fitting.py


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A fork server for this process that imported the worker and the fitting module, with a library named as the
    CUDA driver mapped, as `import torch` maps it on a GPU host (an H200's server ended there); stopped after use."""
    libm = next(line.split()[-1] for line in open("/proc/self/maps") if "/libm.so" in line)
    shutil.copy(libm, tmp_path / "libcuda.so.1")  # a harmless library under the driver's name
    monkeypatch.setenv("DDIPP_TEST_LIBCUDA", str(tmp_path / "libcuda.so.1"))
    forkserver.start(["ddipp.core.group.worker", "driver_fitting"])  # tests/core/workers: FITTING, and the library
    yield forkserver._server
    shutdown()
    forkserver.stop()


def drawn(data, device):
    """test_group's `summed` total, and every rank's pid, parent's pid and a draw of numpy's and torch's generators."""
    total = summed(data, device)[2]
    mine = torch.tensor([os.getpid(), os.getppid(), np.random.randint(1 << 30), torch.randint(1 << 30, ())])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return total, [t.tolist() for t in every]


def die_on_rank1(data, device):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(data)


def _all_end(pids: list, timeout: float = 15) -> bool:
    """Whether the processes `pids` end (or ended) within `timeout` seconds."""
    running = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            running.append(psutil.Process(pid))
    return psutil.wait_procs(running, timeout=timeout)[1] == []


def _forked_pids(server) -> list:
    return [p.pid for p in psutil.Process(server.proc.pid).children()]


@pytest.mark.slow  # starts a fork server and a worker group
def test_workers_forked_from_the_server_fit_as_spawned_ones_with_fresh_generators(server):
    group = group_for(CPU2, 60, FITTING)
    total, ranks = fit(group, drawn)
    assert total.tolist() == [3.0, 5.0, 7.0, 9.0]
    assert {(pid, parent) for pid, parent, *_ in ranks} == {(pid, server.proc.pid) for pid in _forked_pids(server)}
    assert ranks[0][2] != ranks[1][2] and ranks[0][3] != ranks[1][3]  # seeded from the OS, as fresh interpreters


@pytest.mark.slow  # starts a fork server and a worker group
def test_a_forked_rank_killed_is_named_with_its_signal_and_none_is_left(server):
    group = group_for(CPU2, 60, FITTING)
    with pytest.raises(WorkerError) as raised:
        fit(group, die_on_rank1)
    assert "rank 1" in str(raised.value) and "killed by SIGKILL" in str(raised.value)
    assert _forked_pids(server) == []
    assert fit(group_for(CPU2, 60, FITTING), drawn)[0].tolist() == [3.0, 5.0, 7.0, 9.0]


@pytest.mark.slow  # starts a fork server and a worker group
def test_a_group_whose_server_ended_before_forking_spawns_its_workers():
    forkserver.start(["ddipp_no_such_module"])  # the server fails to import it and ends
    try:
        group = group_for(CPU2, 60, FITTING)
        assert fit(group, drawn)[0].tolist() == [3.0, 5.0, 7.0, 9.0]
        assert all(isinstance(proc.spawned, SpawnedWorker) for proc in group.procs)
        assert forkserver.server() is None and isinstance(group_for(("cpu",), 60, FITTING).procs[0], SpawnedWorker)
    finally:
        shutdown()
        forkserver.stop()


@pytest.mark.slow  # starts a fork server and a worker group
def test_a_group_killed_before_the_server_forked_it_leaves_no_worker(tmp_path, monkeypatch):
    """The server still imports (a gate holds it): the group is killed at once; the server kills what it forks."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("DDIPP_TEST_GATE", str(gate))
    forkserver.start(["gated_fitting"])  # tests/core/workers/gated_fitting.py: imported once `gate` exists
    server = forkserver._server
    try:
        killed = group_for(CPU2, 60, FITTING).procs
        _groups[CPU2].kill()
        assert [proc.poll() for proc in killed] == [-signal.SIGKILL] * 2 and CPU2 not in _groups
        gate.touch()
        group = group_for(CPU2, 60, FITTING)  # forked once the server is ready, after the killed group's
        assert fit(group, drawn)[0].tolist() == [3.0, 5.0, 7.0, 9.0]
        forked = sorted(proc.pid for proc in group.procs)  # read from the server, after the killed group's pids
        assert _all_end([server.pids[proc.request] for proc in killed])
        assert sorted(_forked_pids(server)) == forked
    finally:
        shutdown()
        forkserver.stop()


KERNEL = textwrap.dedent("""
    import ipykernel, os, sys, time  # a Jupyter kernel has ipykernel imported: import ddipp starts the fork server
    import ddipp, cloudpickle, torch
    from ddipp.core.group import forkserver
    from ddipp.core.group.group import group_for
    from ddipp.core.group.wire import pickled_data
    from ddipp.core.options import Options
    group = group_for(("cpu", "cpu"), 600, "torch_fitting")
    group.fit(pickled_data(torch.arange(4.0), "data"), [cloudpickle.dumps(lambda data, device: None)] * 2, Options(),
              None)
    print("pids", forkserver.server().proc.pid, *[proc.pid for proc in group.procs], flush=True)
    time.sleep(600)
""")


@pytest.mark.slow  # starts a kernel, its fork server and a worker group
def test_import_ddipp_in_a_kernel_starts_the_server_and_a_killed_kernel_leaves_no_process():
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True)
    try:
        pids = next(line for line in kernel.stdout if line.startswith("pids "))
        server, *workers = map(int, pids.split()[1:])
        assert sorted(p.pid for p in psutil.Process(server).children()) == sorted(workers) and len(workers) == 2
        kernel.kill()
        assert _all_end([server, *workers])
    finally:
        kernel.kill()
        kernel.wait()


@pytest.mark.slow  # starts a fork server and a worker group
def test_a_forked_worker_that_ended_reads_as_ended_before_the_server_says_so(server):
    """CI at stop 48: the kernel looked between the server's reaping of a killed worker and its message saying so,
    found the group alive, and sent the next fit to the dead worker (WorkerDied instead of a new group)."""
    group = group_for(CPU2, 60, FITTING)
    fit(group, drawn)
    worker = psutil.Process(group.procs[0].pid)
    os.kill(server.proc.pid, signal.SIGSTOP)  # the server reaps nothing and says nothing until continued
    resume = threading.Timer(0.5, os.kill, (server.proc.pid, signal.SIGCONT))  # as a loaded machine delays it
    try:
        worker.kill()
        deadline = time.monotonic() + 15
        while worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the zombie, not synchronising: its parent is stopped
        resume.start()
        assert group.procs[0].poll() == -signal.SIGKILL and not group.alive
    finally:
        resume.cancel()
        os.kill(server.proc.pid, signal.SIGCONT)


def test_a_process_that_ends_while_its_stat_is_read_reads_as_ended(monkeypatch):
    """CI after cc4d570: a rank 0 reaped between the open and the read of its /proc stat raised ProcessLookupError out
    of `poll`, in place of the WorkerDied naming it."""
    child = subprocess.Popen(["sleep", "60"])
    stat = open(f"/proc/{child.pid}/stat")
    child.kill()
    child.wait()
    monkeypatch.setattr(forkserver, "open", lambda path: stat, raising=False)  # the file opened before the end
    assert forkserver._exists(child.pid) is False


@pytest.mark.slow  # starts a fork server and worker groups
def test_a_worker_or_the_server_killed_between_fits_is_named_in_one_line_and_the_next_fit_runs_on_a_new_group(
        server, capsys):
    """The notebook idle (the OOM killer's moment): a send to the dead worker raised a bare BrokenPipeError."""
    group = group_for(CPU2, 60, FITTING)
    fit(group, drawn)
    os.kill(group.procs[1].pid, signal.SIGKILL)
    assert _all_end([group.procs[1].pid])
    with pytest.raises(WorkerError, match=r"^ddipp worker rank 1 \(pid \d+, cpu\) was killed by SIGKILL; "):
        group.fit(pickled_data(torch.arange(4.0), "data"), [cloudpickle.dumps(drawn)] * 2, Options(), None)
    assert fit(group_for(CPU2, 60, FITTING), drawn)[0].tolist() == [3.0, 5.0, 7.0, 9.0]
    os.kill(_groups[CPU2].procs[0].pid, signal.SIGKILL)
    assert _all_end([_groups[CPU2].procs[0].pid])
    assert fit(group_for(CPU2, 60, FITTING), drawn)[0].tolist() == [3.0, 5.0, 7.0, 9.0]
    server.proc.kill()
    server.proc.wait()
    assert _all_end([proc.pid for proc in _groups[CPU2].procs])
    group = group_for(CPU2, 60, FITTING)
    assert fit(group, drawn)[0].tolist() == [3.0, 5.0, 7.0, 9.0]
    assert all(isinstance(proc, SpawnedWorker) for proc in group.procs)
    said = capsys.readouterr().err
    assert re.search(r"^ddipp: ddipp worker rank 0 \(pid \d+, cpu\) was killed by SIGKILL between fits; a new group "
                     r"starts$", said, re.M), said
    assert re.search(r"^ddipp: ddipp worker rank 0 \(pid \d+, cpu\) ended with the kernel's fork server, which was "
                     r"killed by SIGKILL between fits; a new group starts$", said, re.M), said


class _Bound:
    """A learner as far as ddipp.core.group.binding needs one: its data, and what bind sets on it."""
    data = torch.arange(4.0)


def _restart_count_after_death(marker: str):
    """A fit whose rank 1 dies unless `marker` exists (it makes it first); rank 0 returns torch elastic's restart count
    its process sees."""
    def call(data, device):
        if dist.get_rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(data)
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    return call


@pytest.mark.slow  # starts a fork server and worker groups
def test_each_fit_restarted_once_runs_its_restart_as_restart_1(server, tmp_path, capsys):
    """A bound learner's second fit restarted once ran as torch elastic's restart 2 (the count climbed across fits)."""
    learn, counts = _Bound(), []
    binding.bind(learn, CPU2, Options(timeout=60, restarts=1), binding.fit_on_group, FITTING)
    for n in (1, 2):
        call = cloudpickle.dumps(_restart_count_after_death(str(tmp_path / f"died{n}")))
        learn.fit("data", lambda held: call, None, lambda results: counts.append(cloudpickle.loads(results[0])),
                  kept=lambda: (0, 0))
    assert counts == [1, 1]
    assert capsys.readouterr().err.count("ddipp: restart 1 of 1: a new group runs the fit again") == 2
