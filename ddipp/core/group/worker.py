"""A worker of the notebook's group: one rank, started by `WorkerGroup`, running the fits the notebook sends.

It joins the process group once (paying the torch/fastai import once), says it is ready, imports in a thread what the
first fit's DDP would (while the notebook's user works), and serves commands on the socket it inherited, each a
method here (`messages` names them). A fit runs in the adapter's fitting module, named in FITTING_ENV
(`adapter.Fitting`); rank 0 relays its progress bars and prints while it fits; a fit that fails sends rank
0's results as of its last completed step, then the error, and leaves the process group. SIGUSR1 asks a fit to stop
(every rank stops after the same step). It exits when its parent dies: the notebook, or the notebook's fork server
(which ends with the notebook); the processes it forks (its data loaders' workers) die with it.
"""
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from .. import dist, resume
from ..dist import CONNECTION_FD_ENV, FITTING_ENV, PARENT_PID_ENV
from ..options import Options
from .adapter import load_fitting
from .messages import DONE, ERROR, READY, STOP
from .wire import HeldTensors, loads, receive, send


def _exit_with_parent() -> None:
    """End this process as soon as the notebook's process is gone (a killed kernel leaves no worker): at once if it
    is gone already; by the kernel's signal until this worker has joined the group (joining may wait for the
    notebook's store holding the GIL); by a watching thread from then on."""
    parent = int(os.environ[PARENT_PID_ENV])
    _signal_when_parent_ends(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="ddipp-parent-watch").start()


def _children_die_with_it() -> None:
    """Have every process this one forks (a DataLoader's workers) killed when it dies: they hold copies of its sockets,
    so a rank killed while its loaders ran left its peers' collectives and the notebook waiting 5 s, until torch's
    watchdog in the loader workers noticed."""
    parent = os.getpid()

    def in_child() -> None:
        _signal_when_parent_ends(signal.SIGKILL)
        if os.getppid() != parent:  # it died before that
            os._exit(1)
    os.register_at_fork(after_in_child=in_child)


def _signal_when_parent_ends(signum: int) -> None:
    """Have Linux send `signum` to this process when the thread that started it ends (0: nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # 1: PR_SET_PDEATHSIG


class Worker:
    """The command loop of one rank."""

    def __init__(self, conn: Connection):
        import torch

        self.conn, self.lock = conn, threading.Lock()
        self.fitting = load_fitting(os.environ[FITTING_ENV])  # imports fastai and its adapter, once
        dist.init()
        signal.signal(signal.SIGUSR1, lambda *_: dist.request_stop())  # the notebook's interrupt, sent to rank 0
        self.rank, self.device = dist.rank(), dist.device()
        self.data_digest, self.data = None, None
        self.held = HeldTensors()  # the model's and optimizer's tensors after the last fit
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    def send(self, message: tuple) -> None:
        with self.lock:
            send(self.conn, message)

    def serve(self) -> None:
        self.send((READY, os.getpid()))
        self.warm_up = threading.Thread(target=_import_what_ddp_imports, daemon=True, name="ddipp-warm-up")
        self.warm_up.start()
        while True:
            try:
                command, *args = receive(self.conn)
            except EOFError:
                return
            if command == STOP:
                return
            try:
                getattr(self, command)(*args)
            except BaseException as e:  # reported, never fatal: the notebook decides what happens to the group
                self.send((ERROR, _pickled_exception(e), traceback.format_exc()))

    def set_context(self, cwd: str, path: list) -> None:
        """Work in the notebook's directory and import from its sys.path (its own modules, before ours)."""
        os.chdir(cwd)
        sys.path[:] = path + [p for p in sys.path if p not in path]

    def keep_data(self, digest: str, blob: bytes, buffers: list) -> None:
        self.data, self.data_digest = None, None  # free the previous data first
        self.data = self.fitting.place_data(loads(blob, device=self.device, buffers=buffers), self.device)
        self.data_digest = digest

    def fit(self, digest: str, call: bytes, options: Options, number: int) -> None:
        if digest != self.data_digest:
            raise RuntimeError(f"ddipp: rank {self.rank} holds data {self.data_digest}, not {digest}")
        self.warm_up.join()  # a compiled model's unpickling imports torch._dynamo too: a second import saw it half-made
        dist.request_stop(False)  # an interrupt meant for an earlier fit
        resume.fit_sent(number)  # what a Checkpoint's file names this fit by
        try:
            result, kept = self.fitting.run_fit(self.data, call, options, self.device,
                                                self.send if self.rank == 0 else None, self.held)
        except BaseException:
            self.leave()
            raise
        self.send((DONE, (result, kept)))

    def leave(self) -> None:
        """Leave the process group (the next fit forms a new one through the notebook's store) and hang up on the
        other ranks, so that a rank waiting for this one in a collective fails now instead of at the timeout. It hangs
        up first: torch 2.4's gloo, destroyed with a collective in flight (DDP's), waits for it with no end."""
        _hang_up(int(os.environ["MASTER_PORT"]))
        dist.leave()


def _import_what_ddp_imports() -> None:
    """Import, while the notebook's user works, what the first fit's DDP constructor would: torch._dynamo (about 900
    modules, 1.5-2 s of a core), read for a setting whatever the model; a fit that comes sooner waits for it first."""
    import torch._dynamo  # noqa: F401


def _hang_up(store_port: int) -> None:
    """Shut down this process's TCP connections on loopback but the store's: a notebook's group has only its ranks'
    there (gloo's, which gloo keeps open after the process group is destroyed, however it is destroyed)."""
    for name in os.listdir("/dev/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:  # the listing's own descriptor, closed since
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                host, port = sock.getpeername()[:2]
                if port != store_port and ipaddress.ip_address(host).is_loopback:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected (a listener), or no longer
                pass


def _pickled_exception(e: BaseException):
    import cloudpickle
    try:
        return cloudpickle.dumps(e)
    except Exception:
        return None


def main() -> None:
    """Entry point of a worker process (see `WorkerGroup`)."""
    _exit_with_parent()
    conn = Connection(int(os.environ[CONNECTION_FD_ENV]))
    try:
        worker = Worker(conn)
    except BaseException as e:
        send(conn, (ERROR, _pickled_exception(e), traceback.format_exc()))
        raise
    _signal_when_parent_ends(0)  # joined: the notebook thread that started this worker may end (a fit run in a thread)
    _children_die_with_it()
    worker.serve()
    dist.teardown()
