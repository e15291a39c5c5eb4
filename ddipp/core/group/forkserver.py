"""A Jupyter kernel's fork server: one process, started by `import ddipp` in the kernel, that imports torch, fastai
and what a worker's first fit imports, in the background while the user works; `WorkerGroup` forks its workers from
it, so a group starts with those imports paid (4-8 s of a core each).

The kernel itself is never forked (once it used CUDA, a fork fails at its first CUDA call); the server never touches
CUDA (it asks NVML whether a GPU exists), and forks only while it runs one Python thread and its children can use
CUDA, else it exits and the workers start as fresh interpreters. It ends with the kernel, killing the workers it forked.
"""
import atexit
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

SOCKET_FD_ENV = "DDIPP_FORK_SERVER_FD"  # the server's end of its socket to the kernel
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds ddipp
_MESSAGE_BYTES = 1 << 20  # the largest request (a worker's environment) or reply


def pythonpath(environ: Mapping[str, str]) -> str:
    """`environ`'s PYTHONPATH with the folder that holds ddipp first: what a process ddipp starts imports from."""
    return os.pathsep.join(filter(None, [_PACKAGE_ROOT, environ.get("PYTHONPATH")]))


def worker_modules(fitting: str) -> List[str]:
    """What a notebook worker imports before its first fit with the adapter's module `fitting`: the server's preload."""
    return ["ddipp.core.group.worker", fitting, "torch._dynamo"]  # DDP's constructor and the optimizer import dynamo


class ForkServer:
    """The kernel's handle on its fork server: asks it for workers and reads back their pids and exit codes."""

    def __init__(self, preload: List[str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message a request or reply
        env = dict(os.environ, **{SOCKET_FD_ENV: str(theirs.fileno())}, PYTORCH_NVML_BASED_CUDA_CHECK="1",
                   PYTHONPATH=pythonpath(os.environ))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from ddipp.core.group.forkserver import serve; serve()", *preload], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
            start_new_session=True)  # a terminal's Ctrl-C reaches the kernel only
        theirs.close()
        self.sock, self.lock = ours, threading.Lock()
        self.requests = 0
        self.pids: Dict[int, int] = {}  # request number -> the pid of the worker forked for it
        self.exits: Dict[int, int] = {}  # pid -> exit code (negative: the signal), as Popen.returncode
        self.open = True  # False once the server ended: requests not forked by then are not forked

    def fork(self, env: Dict[str, str], conn: socket.socket, log: Path,
             spawn: Callable[[], subprocess.Popen]) -> "ForkedWorker":
        """A worker running ddipp's worker main in the environment `env` (the server sets its parent pid and the fd of
        `conn`, its socket to the kernel), writing to `log`; `spawn()` starts it if the server ends first."""
        with self.lock:
            self.requests += 1
            socket.send_fds(self.sock, [pickle.dumps(("fork", self.requests, env, str(log)))], [conn.fileno()])
            return ForkedWorker(self, self.requests, conn, spawn)

    def cancel(self, request: int) -> None:
        """Have the server kill the worker of `request` as soon as it forked it."""
        with self.lock:
            with contextlib.suppress(OSError):  # the server ended, and its workers with it
                self.sock.send(pickle.dumps(("cancel", request, None, None)))

    def read(self, timeout: float = 0.0) -> None:
        """Read what the server said (workers forked, workers ended), waiting up to `timeout` s for a first reply."""
        with self.lock:
            while self.open and wait([self.sock], timeout):
                timeout = 0.0
                try:
                    message = self.sock.recv(_MESSAGE_BYTES)
                except OSError:
                    message = b""
                if not message:
                    self.open = False
                    self.proc.wait()
                    break
                kind, key, value = pickle.loads(message)
                (self.pids if kind == "forked" else self.exits)[key] = value

    def close(self) -> None:
        """Stop the server: it kills the workers it forked that still run, then ends (killed if it does not)."""
        self.sock.close()
        self.open = False
        try:
            self.proc.wait(timeout=5 if self.pids else 0)  # none forked: it may still be importing
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedWorker:
    """A worker asked of the fork server, as `WorkerGroup` uses a Popen (pid, poll, wait) plus `kill_group`; if the
    server ends before forking it, `spawn()` starts it instead, as a fresh interpreter. Holds the worker's end of its
    socket (`conn`) until one of them has it."""

    def __init__(self, server: ForkServer, request: int, conn: socket.socket, spawn: Callable[[], subprocess.Popen]):
        self.server, self.request, self.conn, self.spawn = server, request, conn, spawn
        self.spawned: Optional[subprocess.Popen] = None
        self.cancelled = False  # killed before the server forked it
        self.server_end: Optional[int] = None  # the server's exit code (negative: a signal) if the worker ended with it

    def _pid(self, timeout: float = 0.0) -> Optional[int]:
        """The worker's pid once forked or spawned (spawning it if the server ended first), waiting up to `timeout` s
        for the server's reply; None before."""
        if self.conn is not None:
            if self.request not in self.server.pids:
                self.server.read(timeout)
            if self.request not in self.server.pids and not self.server.open and not self.cancelled:
                self.spawned = self.spawn()
            if self.spawned is not None or self.request in self.server.pids:
                self.conn.close()
                self.conn = None
        return self.spawned.pid if self.spawned is not None else self.server.pids.get(self.request)

    @property
    def pid(self) -> Optional[int]:
        """Asked once the worker spoke or ended: the server's reply is read by then or on its way."""
        while (pid := self._pid(1.0)) is None and not self.cancelled:
            pass
        return pid

    def poll(self) -> Optional[int]:
        """The exit code (negative: the signal), None while the worker runs or waits to be forked."""
        pid = self._pid()
        if self.spawned is not None:
            return self.spawned.poll()
        if self.cancelled:
            return self.server.exits.get(pid, -signal.SIGKILL)
        if pid is None:
            return None
        if pid not in self.server.exits:
            self.server.read()  # what the server said since: this worker's end, or its own
        deadline = time.monotonic() + 10
        while pid not in self.server.exits and self.server.open and not _exists(pid) and time.monotonic() < deadline:
            self.server.read(1.0)  # it ended: the server, woken by SIGCHLD, reaps it and says so at once
        if pid not in self.server.exits and not self.server.open and not _exists(pid):
            self.server.exits[pid] = 1  # ended with the server (it kills its workers), its code unknown
            self.server_end = self.server.proc.returncode
        return self.server.exits.get(pid)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if self.spawned is not None:
                return self.spawned.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired("ddipp worker", timeout)
            self.server.read(min(left, 1.0))
        return code

    def kill_group(self) -> None:
        """SIGKILL the worker and the processes it started; one not forked yet is, by the server, once it is."""
        pid = self._pid()
        if pid is not None:
            kill_group(pid)
        else:
            self.cancelled = True
            self.server.cancel(self.request)
            self.conn.close()
            self.conn = None


def kill_group(pid: int) -> None:
    """SIGKILL worker `pid` and its process group (its session: its data loaders), gone or not; the worker itself too
    in case it was forked so recently that it did not start its session yet."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    """Whether process `pid` runs: not a zombie, which a container's first process may never reap."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between the open and the read
        return False


_server: Optional[ForkServer] = None


def in_a_kernel() -> bool:
    """Whether this process is a Jupyter kernel (not a process it started with multiprocessing)."""
    import multiprocessing
    return "ipykernel" in sys.modules and multiprocessing.parent_process() is None


def start(preload: List[str]) -> None:
    """Start this process's fork server, importing the modules `preload` (once a process; the group uses it)."""
    global _server
    if _server is None:
        try:
            _server = ForkServer(preload)
        except OSError:  # no process could start (a limit reached): the workers will start as fresh interpreters
            return
        atexit.register(stop)


def server() -> Optional[ForkServer]:
    """This process's fork server if it runs, else None (the group spawns its workers)."""
    if _server is not None:
        _server.read()
        if _server.open:
            return _server
    return None


def stop() -> None:
    """Stop this process's fork server, if one runs (a new one may start after)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


# The server's side: runs in the process ForkServer starts.

def serve() -> None:
    """Import sys.argv[1:], then fork a worker for each request until the kernel ends (its socket closes, or this
    process's parent changes); then kill the workers still running. Exits at once if forking is not safe."""
    import importlib
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends with the kernel only; its workers get Python's handler back
    sock = socket.socket(fileno=int(os.environ.pop(SOCKET_FD_ENV)))
    kernel = os.getppid()
    for name in sys.argv[1:]:
        importlib.import_module(name)
    if _fork_unsafe():
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the wait below
    workers: Dict[int, int] = {}  # request number -> pid, of the workers running
    try:
        while os.getppid() == kernel:
            ready = wait([sock, wake_r], timeout=1.0)
            if wake_r in ready:
                os.read(wake_r, 512)
            _reap(sock, workers)
            if sock in ready:
                message, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 1)
                if not message:
                    return
                kind, request, env, log = pickle.loads(message)
                if kind == "cancel":
                    if request in workers:
                        kill_group(workers[request])
                    continue
                pid = os.fork()
                if pid == 0:
                    _run_worker(env, log, fds[0], closing=[sock.fileno(), wake_r, wake_w])
                os.close(fds[0])
                workers[request] = pid
                sock.send(pickle.dumps(("forked", request, pid)))
    except (BrokenPipeError, ConnectionResetError):  # the kernel ended
        pass
    finally:
        for pid in workers.values():
            kill_group(pid)


def _fork_unsafe() -> bool:
    """Whether a fork of this process would inherit a Python thread's state (a thread but this one) or could not use
    CUDA: torch's CUDA initialised, or on a GPU host a probe child that torch marks a bad fork. The driver library
    mapped is no bar (torch's CUDA 13 wheels map it at import; a child forked then used CUDA on an H200), and OpenBLAS's
    threads, which numpy and scipy start, stop themselves at a fork."""
    import torch
    if torch.cuda.is_initialized() or threading.active_count() > 1:
        return True
    if not torch.cuda.is_available():  # through NVML (the server's environment): CUDA does not matter here
        return False
    probe = os.fork()
    if probe == 0:
        os._exit(int(torch.cuda._is_in_bad_fork()))
    return os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1]) != 0


def _reap(sock: socket.socket, workers: Dict[int, int]) -> None:
    """Collect the workers that ended and tell the kernel their exit codes."""
    for request, pid in list(workers.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            del workers[request]
            sock.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))


def _run_worker(env: Dict[str, str], log: str, conn_fd: int, closing: List[int]) -> None:
    """In the forked child: become a worker as a fresh interpreter started with `env` would (its own session, output to
    `log`, fresh generator states), run the worker's main and exit with its code, never returning."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in closing:
            os.close(fd)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        from ..dist import CONNECTION_FD_ENV, PARENT_PID_ENV
        os.environ.clear()
        os.environ.update(env, **{PARENT_PID_ENV: str(os.getppid()), CONNECTION_FD_ENV: str(conn_fd)})
        sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        _fresh_generators()
        from .worker import main
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # as the interpreter's exit would: torch's and the worker's own handlers
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fresh_generators() -> None:
    """Seed numpy's and torch's generators from the OS, as a fresh interpreter's are (python's random reseeds itself
    at a fork)."""
    import numpy as np
    import torch
    np.random.seed()
    torch.seed()
