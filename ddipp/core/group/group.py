"""The notebook's persistent group of worker processes: start, run a fit on it, report failures, stop.

Workers are never a fork of the kernel (so a kernel that already used CUDA is fine): forks of the kernel's fork server
(`forkserver`) if it runs, else fresh interpreters; started in the background (the first fit waits until they are
ready), each in its own session so that a terminal's Ctrl-C reaches the notebook only, which then stops them all.
The notebook hosts the rendezvous store, on loopback, for the group's life (the ranks meet there again after a
failed fit); each worker talks to the notebook over a private socket. A fit that fails keeps what rank 0 trained up to
its last completed step, if rank 0 lives to send it (else binding keeps the fit's Checkpoint file); the workers stay
when every rank ended its fit and lives (they form a new process group at the next fit), else the group stops and the
next fit starts a new one.
"""
import atexit
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import cloudpickle

from .. import dist as ddist
from . import forkserver
from ..files import owned_dir_prefix, sweep_stale_dirs
from ..notes import add_note
from ..options import Options
from ..store import LOOPBACK, loopback_listener, loopback_store
from .messages import DONE, ERROR, FIT, KEEP_DATA, LEAVE, READY, SET_CONTEXT, STOP
from .wire import broadcast, receive, send

START_TIMEOUT = 300  # seconds a worker may take to import torch and fastai and join the group
LOGS_KIND = "ddipp-workers"  # the workers' logs: a folder in the temp dir, removed when the group stops
STOP_DEADLINE = 4  # seconds an interrupted fit's ranks have to stop and send back what they trained
PEER_GRACE = 5  # seconds the other ranks have to end their fit (and rank 0 to send what it trained) once one failed


class WorkerError(RuntimeError):
    """A rank failed without an exception the notebook can rebuild: it died, or its error did not unpickle."""


class WorkerDied(WorkerError):
    """A rank's process ended in a fit without an error (killed: out of memory, preempted, a signal)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, shown as the cause of the exception re-raised here."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class SpawnedWorker(subprocess.Popen):
    """A worker started as a fresh interpreter, in its own session."""

    def kill_group(self) -> None:
        """SIGKILL the worker and the processes it started (its data loaders)."""
        forkserver.kill_group(self.pid)


class WorkerGroup:
    """One worker process per device ("cpu" for each CPU process), ranks in the order of `devices`, fitting with the
    adapter's module `fitting` (`adapter.Fitting`); `after`, a group whose worker died, is the one it replaces: its
    workers are the `attempt`-th restart of the fit that group ran (torch elastic's restart count, the same launch id
    and fit numbers, which a Checkpoint's file names), so the fit resumes there."""

    def __init__(self, devices: Tuple[str, ...], timeout: float, fitting: str, after: "WorkerGroup" = None,
                 attempt: int = 0):
        self.devices, self.timeout, self.fitting = devices, timeout, fitting
        self.launch_id = after.launch_id if after else uuid.uuid4().hex
        self.attempt = attempt
        self.fits = after.fits - 1 if after else 0  # the fits sent; a restart sends its group's last one again
        self.learners = weakref.WeakValueDictionary()  # id -> a learner bound to this group (Learner is unhashable)
        self.data_digest = None
        # rank -> digests of the tensors it kept from the last fit (its call names them); each rank's own, since a
        # sharding strategy keeps a different part on each; empty before the first fit
        self.held: Dict[int, frozenset] = {}
        self.last_sent = {}  # bytes the last fit sent: "data", "call" (each distinct call written once), "results" back
        self.procs: List[Union[SpawnedWorker, forkserver.ForkedWorker]] = []
        self.conns: List[Connection] = []
        self.replies: Dict[int, Any] = {}  # rank -> its answer to the last command ("ready", "done")
        self.unanswered = set()  # the ranks that neither answered nor failed when the last command ended
        self.trained = None  # what rank 0 trained in a fit that failed, as of its last completed step (results)
        self.failed_rank = None  # the rank whose error the last failed command raised
        self.errors = {}  # rank -> (blame, error) of the ranks that failed, while `_collect` serves a command
        self.receiving = False  # True while a message is being read: an interrupt there leaves half of it
        self.started, self.ready = time.monotonic(), False
        sweep_stale_dirs(Path(tempfile.gettempdir()), LOGS_KIND)  # left by notebooks that were killed
        self.logs = Path(tempfile.mkdtemp(prefix=owned_dir_prefix(LOGS_KIND)))
        try:  # an interrupt from here on (a restart's group starting) leaves neither workers nor their logs
            self.store = loopback_store(loopback_listener(), timedelta(seconds=START_TIMEOUT))
            self.store.set(ddist.LAUNCH_ID_KEY, self.launch_id)  # what every worker's dist.launch_id() reads
            if len(devices) > 1:
                threads = worker_env(0, devices, timeout, self.store.port, fitting)["OMP_NUM_THREADS"]
                print(f"ddipp: {ddist.cores_shared(len(devices), threads)}", flush=True)
            print(f"ddipp: starting {len(devices)} workers on {', '.join(devices)} in the background (the first fit "
                  "waits for them)", flush=True)
            for rank in range(len(devices)):  # each environment made as its worker starts
                self._spawn(rank, worker_env(rank, devices, timeout, self.store.port, fitting, self.attempt))
        except BaseException:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def _spawn(self, rank: int, env: Dict[str, str]) -> None:
        """Start rank `rank` with the environment `env` and its socket to this process: forked from the kernel's fork
        server if it runs, else a fresh interpreter."""
        ours, theirs = socket.socketpair()
        log = self.logs / f"rank{rank}.log"

        def spawn() -> SpawnedWorker:
            with open(log, "ab") as out:
                return SpawnedWorker([sys.executable, "-c", "from ddipp.core.group.worker import main; main()"],
                                     env=dict(env, **{ddist.CONNECTION_FD_ENV: str(theirs.fileno())}),
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     pass_fds=[theirs.fileno()], start_new_session=True)
        server = forkserver.server()
        try:
            worker = server.fork(env, theirs, log, spawn) if server else None
        except OSError:  # the server just ended
            worker = None
        if worker is None:
            worker = spawn()
            theirs.close()
        self.procs.append(worker)
        self.conns.append(Connection(ours.detach()))

    def fit(self, data: Tuple[str, bytes, list], calls: Sequence[bytes], options: Options,
            mirror: Any) -> Tuple[list, bool]:
        """Run one fit of the `data` (`wire.pickled_data`) on every rank, rank r's request `calls[r]` (the ranks given
        equal bytes share one message, written once), replaying rank 0's progress events on `mirror` (called with each
        event's name and arguments; `mirror.interrupt()` when a fit is interrupted): rank 0's results and whether an
        interrupt stopped the fit (every rank after the same step; what was trained comes back all the same)."""
        self.wait_ready()
        interrupted, self.trained, self.unanswered = False, None, set(range(len(self.conns)))
        self.fits += 1
        try:
            try:
                for conn in self.conns:
                    send(conn, (SET_CONTEXT, os.getcwd(), sys.path))
                data_bytes = self._keep_data(*data)
                sharing: Dict[bytes, List[Connection]] = {}
                for conn, call in zip(self.conns, calls):
                    sharing.setdefault(call, []).append(conn)
                for call, conns in sharing.items():
                    broadcast(conns, (FIT, self.data_digest, call, options, self.fits))
            except OSError as e:  # a worker died since group_for looked
                raise self._death(self._dead_rank()) from e
            self.replies = {}
            try:
                self._collect(DONE, on_event=mirror)
            except KeyboardInterrupt:
                interrupted = True
                self._stop_fit(mirror)
            results = self.replies[0][0]
            self.held = {rank: frozenset(kept) for rank, (_, kept) in self.replies.items()}
            self.last_sent = dict(data=data_bytes, call=sum(map(len, sharing)), results=sum(map(len, results)))
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt) or self.unanswered or not self.alive:
                self.kill()
            else:  # every rank ended the fit and lives: they form a new process group at the next fit
                self._leave()
            if isinstance(e, KeyboardInterrupt):
                mirror.interrupt()
            raise
        return results, interrupted

    def wait_ready(self) -> None:
        """Wait until every worker started (imported torch and the adapter, joined the store) unless they did; a
        worker that failed to, or none in START_TIMEOUT seconds, stops the group and raises."""
        if self.ready:
            return
        try:
            self._collect(READY, deadline=self.started + START_TIMEOUT, late=self._not_started)
        except BaseException:
            print("ddipp: the workers did not start", file=sys.stderr, flush=True)
            self.kill()
            raise
        self.ready = True
        print(f"ddipp: workers ready in {time.monotonic() - self.started:.1f} s", flush=True)

    def _leave(self) -> None:
        """After a failed fit: every rank leaves its process group (those the failure did not reach too), so all
        of them meet again at the next fit; what they held is the failed fit's, so the next one sends it all."""
        for conn in self.conns:
            send(conn, (LEAVE,))
        self.held = {}

    def _stop_fit(self, mirror: Any) -> None:
        """After an interrupt: ask the ranks to stop after the same step and wait STOP_DEADLINE seconds for what they
        trained; a second interrupt, or none in time, raises KeyboardInterrupt (and the group is killed)."""
        if self.receiving:  # interrupted within a message: the stream cannot be trusted any more
            raise KeyboardInterrupt
        os.kill(self.procs[0].pid, signal.SIGUSR1)  # rank 0 passes it on to the others with the step's loss
        self._collect(DONE, on_event=mirror, deadline=time.monotonic() + STOP_DEADLINE, late=KeyboardInterrupt)

    def _keep_data(self, data_digest: str, blob: bytes, buffers: list) -> int:
        """Send the pickled data to every worker unless they already keep an equal one; the bytes written for them."""
        if data_digest == self.data_digest:
            return 0
        self.data_digest = None
        written = broadcast(self.conns, (KEEP_DATA, data_digest, blob, buffers))
        self.data_digest = data_digest
        return written

    def _collect(self, expected: str, on_event: Callable = None, deadline: Optional[float] = None,
                 late: Callable[[], BaseException] = None) -> None:
        """Serve the workers' messages until every rank sent `expected` (its reply lands in `self.replies`), or
        failed; raise `late()` past the deadline. Each message goes to the `_on_<name>` method of its name, a progress
        event to `on_event`. Once a rank failed, the others have PEER_GRACE seconds to end too (`self.unanswered`:
        those that did not); then the error to read is raised."""
        pending = {conn: rank for rank, conn in enumerate(self.conns) if rank not in self.replies}
        try:
            self._serve(pending, expected, on_event, deadline, late)
        finally:
            errors, self.errors = self.errors, {}  # held no longer: a traceback holds the fit's learner
        self.unanswered = set(pending.values())
        if errors:  # a rank's own error first, then a death, then a failure caused by a peer's; of the lowest rank
            _, self.failed_rank, error = min((blame, rank, error) for rank, (blame, error) in errors.items())
            raise error

    def _serve(self, pending: Dict[Connection, int], expected: str, on_event: Callable, deadline: Optional[float],
               late: Callable[[], BaseException]) -> None:
        """`_collect`'s loop: serve the messages of the `pending` ranks (rank by connection), taking off those that
        answered or failed, until none is left or the other ranks' grace after a failure ended."""
        grace_ends = None
        while pending:
            for conn in wait(list(pending), timeout=1.0):
                rank = pending[conn]
                self.receiving = True
                try:
                    kind, *args = receive(conn)
                except (EOFError, OSError):
                    kind, args = None, ()
                finally:
                    self.receiving = False
                if kind is None:
                    self._on_died(rank)
                elif hasattr(self, f"_on_{kind}"):
                    getattr(self, f"_on_{kind}")(rank, *args)
                else:
                    on_event(kind, *args)
                if kind in (expected, ERROR, None):
                    del pending[conn]
            for conn, rank in list(pending.items()):
                if self.procs[rank].poll() is not None and not conn.poll():  # dead, nothing left to read
                    self._on_died(rank)
                    del pending[conn]
            grace_ends = grace_ends or (time.monotonic() + PEER_GRACE if self.errors else None)
            if grace_ends is not None and time.monotonic() > grace_ends:
                break
            if pending and deadline is not None and time.monotonic() > deadline and not self.errors:
                raise late()

    def _on_ready(self, rank: int, pid: int) -> None:
        self.replies[rank] = pid

    def _on_done(self, rank: int, answer: tuple) -> None:
        """A fit's end: rank 0's results (None from the others) and the digests of the tensors the rank keeps."""
        self.replies[rank] = answer

    def _on_trained(self, rank: int, results: list) -> None:
        """What rank 0 trained up to its last completed step, ahead of the error of its failed fit."""
        self.trained = results

    def _on_out(self, rank: int, stream: str, text: str) -> None:
        (sys.stderr if stream == "stderr" else sys.stdout).write(text)

    def _on_error(self, rank: int, pickled: Optional[bytes], remote_traceback: str) -> None:
        """Rank `rank` raised; a failure caused by a peer's is blamed after the others (`_collect` raises one)."""
        error = _remote_error(rank, pickled, remote_traceback)
        self.errors[rank] = (2 if ddist.peer_failure(error) else 0, error)

    def _on_died(self, rank: int) -> None:
        """Rank `rank`'s connection ended: it died (or hung up) without an error."""
        self.errors[rank] = (1, self._death(rank))

    def say_kept(self, epoch: int, steps: int) -> None:
        """Say, after a failed fit, that the learner keeps what rank 0 trained: `steps` steps, the last in `epoch`."""
        print(f"ddipp: the fit failed on rank {self.failed_rank}; the learner keeps what rank 0 trained up to its last "
              f"completed step (step {steps} of the fit, in epoch {epoch})", file=sys.stderr)

    def _not_started(self) -> WorkerError:
        late = min(rank for rank in range(len(self.conns)) if rank not in self.replies)
        return WorkerError(f"ddipp workers did not start within {START_TIMEOUT} s; {self._log_tail(late)}")

    def _dead_rank(self) -> int:
        """The first rank whose process ended (waiting up to 5 s for one: its connection failed first)."""
        deadline = time.monotonic() + 5
        while True:
            dead = [rank for rank, proc in enumerate(self.procs) if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                return dead[0] if dead else 0
            wait(self.conns, timeout=0.1)  # a dead worker's connection reads as ended at once

    def _death(self, rank: int) -> WorkerDied:
        return WorkerDied(f"{self.died(rank)}; {self._log_tail(rank)}")

    def died(self, rank: int) -> str:
        """How rank `rank`'s process ended, in words naming it: its signal or exit code."""
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = ("closed its connection" if code is None else
               f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
        server = getattr(proc, "server_end", None)
        if server is not None:
            how = (f"ended with the kernel's fork server, which was killed by {signal.Signals(-server).name}"
                   if server < 0 else f"ended with the kernel's fork server, which exited with code {server}")
        return f"ddipp worker rank {rank} (pid {proc.pid}, {self.devices[rank]}) {how}"

    def _log_tail(self, rank: int, lines: int = 20) -> str:
        """The last `lines` lines rank `rank` wrote to its log, its blank lines at either end left out."""
        try:
            text = (self.logs / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()[-lines:]
        except FileNotFoundError:
            text = []
        return "its output ended with:\n" + "\n".join(text) if text else "it printed nothing"

    def stop(self) -> None:
        """Ask the workers to leave, then make sure they are gone."""
        for conn in self.conns:
            try:
                send(conn, (STOP,))
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Kill every worker and whatever it started (its data loader processes), at once."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill_group()
        for proc in self.procs:
            proc.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.data_digest, self.store, self.held = [], [], None, None, {}
        if _groups.get(self.devices) is self:
            del _groups[self.devices]
        shutil.rmtree(self.logs, ignore_errors=True)


def worker_env(rank: int, devices: Tuple[str, ...], timeout: float, store_port: int, fitting: str, attempt: int = 0,
               environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The environment rank `rank` of a notebook's group on `devices` starts in, all but its socket to the notebook:
    `environ`, with what torch's elastic agent sets for a rank launched on one host (its store on loopback at
    `store_port`, its restart count `attempt`), ddipp's `rank_env`, this package first on the path, the notebook's pid
    and the adapter's `fitting` module."""
    cpu = devices[0] == "cpu"
    device_list = "cpu" if cpu else ",".join(d.split(":")[1] for d in devices)
    world = str(len(devices))
    return dict(environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                MASTER_ADDR=LOOPBACK, MASTER_PORT=str(store_port), TORCHELASTIC_USE_AGENT_STORE="True",
                PYTHONPATH=forkserver.pythonpath(environ),
                **{ddist.ATTEMPT_ENV: str(attempt), ddist.PARENT_PID_ENV: str(os.getpid()),
                   ddist.FITTING_ENV: fitting},
                **ddist.rank_env(device_list, timeout, len(devices), True, environ))


def _remote_error(rank: int, pickled: Optional[bytes], remote_traceback: str) -> BaseException:
    """The exception a worker raised, rebuilt when possible, carrying its rank and remote traceback."""
    try:
        error = cloudpickle.loads(pickled) if pickled else None
    except Exception:
        error = None
    if not isinstance(error, BaseException):
        error = WorkerError(f"ddipp worker rank {rank} raised an exception that could not be rebuilt here")
    add_note(error, f"(raised on rank {rank} of the ddipp worker group; the remote traceback is above)")
    error.__cause__ = RemoteTraceback(remote_traceback)
    return error


_groups: Dict[Tuple[str, ...], WorkerGroup] = {}


def group_for(devices: Tuple[str, ...], timeout: float, fitting: str, after: WorkerGroup = None,
              attempt: int = 0) -> WorkerGroup:
    """The running group on `devices`, started (or restarted with the new timeout or fitting module) when needed, as
    the `attempt`-th restart of `after`'s fit if given (a group whose worker died); a group that no learner uses any
    more is stopped first if it holds one of these devices."""
    group = _groups.get(devices)
    if group is not None and not group.alive:  # a worker died between fits (out of memory, a signal)
        dead = next(rank for rank, proc in enumerate(group.procs) if proc.poll() is not None)
        print(f"ddipp: {group.died(dead)} between fits; a new group starts", file=sys.stderr, flush=True)
    if group is not None and (not group.alive or (group.timeout, group.fitting) != (timeout, fitting)):
        group.stop()
        group = None
    if group is None:
        overlapping = [g for g in _groups.values() if set(g.devices) & set(devices)]
        if overlapping:
            gc.collect()  # a dropped learner may wait in a reference cycle
        for idle in [g for g in overlapping if not g.learners]:
            idle.stop()  # no learner uses it any more (dropped without from_ddp): free its devices
        group = _groups[devices] = WorkerGroup(devices, timeout, fitting, after, attempt)
    return group


def shutdown() -> None:
    """Stop every worker group of this process and free their devices."""
    for group in list(_groups.values()):
        group.stop()


atexit.register(shutdown)
