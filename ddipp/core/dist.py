"""The process group: what the launch environment says, which device a rank uses, init and teardown.

Every helper returns single-process values (rank 0 of 1, the default device) when nothing launched
this process, so the same script runs with and without DDP.
"""
import atexit
import json
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .files import replacing
from .notes import add_note

DEVICES_ENV = "DDIPP_DEVICES"  # set by ddipp.launch: "3,1" (local rank i runs on the i-th GPU) or "cpu"
CONNECTION_FD_ENV = "DDIPP_CONNECTION_FD"  # set by the notebook's worker group: a worker's socket to the notebook
PARENT_PID_ENV = "DDIPP_PARENT_PID"  # a notebook worker's parent: the notebook or its fork server (it ends with it)
FITTING_ENV = "DDIPP_FITTING"  # set by the notebook's worker group: the adapter's fitting module (group/adapter.py)
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torch's elastic agent: 0, then 1, 2, ... each time it restarts
TIMEOUT_ENV = "DDIPP_TIMEOUT"  # seconds a collective may wait for the other ranks (torch's default if unset)
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torch's elastic agent: where a rank's failure is told to it
PEER_FAILURE_KEY = "ddipp_peer_failure"  # true in the error file of a rank that a peer's failure stopped
GLOO_IFNAME_ENV, NCCL_IFNAME_ENV = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"  # the interface their sockets use


def launched() -> bool:
    """True in a process started by a distributed launcher (torch elastic / ddipp.launch)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """Global rank of this process (0 when not launched)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def local_rank() -> int:
    """Rank of this process on its host (0 when not launched)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size() -> int:
    """Number of processes in the group (1 when not launched)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_rank0() -> bool:
    """True on the process that draws progress and writes files."""
    return rank() == 0


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, as fastai counts them)."""
    return len(os.sched_getaffinity(0))


def cores_per_rank(ranks_on_host: int) -> int:
    """A rank's fair share of the host's cores: the cores divided by the ranks on the host, never below 1."""
    return max(1, host_cores() // max(1, ranks_on_host))


def loader_workers(num_workers: int, fastai_default: int) -> int:
    """How many worker processes a loader gets on this rank: fastai's default (one per core, `fastai_default`)
    becomes the rank's share of the host's cores (LOCAL_WORLD_SIZE ranks share it); a number the user chose stays."""
    if num_workers != fastai_default:
        return num_workers
    return min(num_workers, cores_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def rank_env(devices: str, timeout: float, ranks_on_host: int, one_host: bool,
             environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What ddipp adds to the environment of each rank of a group, launched or a notebook's: the device list ("3,1" or
    "cpu"), the collectives' `timeout`, the rank's share of the host's cores as OpenMP threads when several ranks share
    it, and on `one_host` gloo and NCCL on loopback; what `environ` sets itself wins."""
    env = {DEVICES_ENV: devices, TIMEOUT_ENV: str(timeout)}
    if ranks_on_host > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(cores_per_rank(ranks_on_host))
    if one_host:
        env.update(loopback_env(environ))
    return env


def cores_shared(ranks_on_host: int, threads: str) -> str:
    """How the host's cores are shared by its `ranks_on_host` processes, each running `threads` OpenMP threads."""
    return (f"{ranks_on_host} processes share {host_cores()} cores: OMP_NUM_THREADS={threads} each, and "
            f"num_workers={cores_per_rank(ranks_on_host)} for a fastai loader left at fastai's default; set either to "
            f"choose")


def loopback_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to add to a one-host group's environment so that gloo and NCCL listen on loopback only (the user's
    own settings win); without them gloo listens on the address the host name resolves to, reachable by others."""
    unset = [name for name in (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV) if not environ.get(name)]
    lo = _loopback_interface() if unset else ""
    values = {GLOO_IFNAME_ENV: lo, NCCL_IFNAME_ENV: f"={lo}"}  # "=": NCCL takes the exact name, not a prefix
    return {name: values[name] for name in unset}


def _loopback_interface() -> str:
    """The name of this host's loopback interface: "lo" (Linux) or "lo0" (macOS)."""
    names = sorted(name for _, name in socket.if_nameindex())
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface (lo, lo0) among this host's interfaces {names}; "
                       f"set {GLOO_IFNAME_ENV} and {NCCL_IFNAME_ENV} to the name of yours")


def device() -> torch.device:
    """The device this rank trains on: the local rank's entry of ddipp's device list, else cuda:LOCAL_RANK or cpu."""
    devices = os.environ.get(DEVICES_ENV)
    if devices == "cpu":
        return torch.device("cpu")
    if devices:
        return torch.device("cuda", int(devices.split(",")[local_rank()]))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank() if launched() else torch.cuda.current_device())


def bind_device() -> torch.device:
    """Make this rank's device torch's current CUDA device (a no-op on CPU); the device."""
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def parse_gpus(spec: str, device_count: int) -> list[int]:
    """The GPU indices ``--gpus`` lists, in order ("all": every GPU); ValueError naming the problem if bad."""
    if spec == "all":
        if device_count == 0:
            raise ValueError(_no_gpu("--nproc N"))
        return list(range(device_count))
    gpus = []
    for item in spec.split(","):
        if not item.strip().isdecimal():
            raise ValueError(f"{item!r} is not a GPU index; give indices like --gpus 0,1 or --gpus all")
        gpus.append(int(item))
    check_gpus(gpus, device_count, "--gpus 0,1", "--nproc N")
    return gpus


def check_gpus(gpus: list[int], device_count: int, example: str, cpu_example: str) -> None:
    """ValueError if `gpus` repeats a GPU or names one this host lacks; the fixes are spelt like `example`
    (a valid list, as the user writes it) and `cpu_example` (how to ask for CPU processes instead)."""
    for i, gpu in enumerate(gpus):
        if gpu in gpus[:i]:
            raise ValueError(f"GPU {gpu} listed twice; give each GPU once, e.g. {example}")
    for gpu in gpus:
        if device_count == 0:
            raise ValueError(_no_gpu(cpu_example))
        if gpu >= device_count:
            raise ValueError(f"GPU {gpu} does not exist; this host has {device_count} GPU"
                             f"{'s' if device_count > 1 else ''} (0-{device_count - 1})")


def _no_gpu(cpu_example: str) -> str:
    return f"this host has no GPU; use {cpu_example} to run N CPU processes"


def init() -> bool:
    """Join the process group the launcher described (NCCL on CUDA, gloo on CPU); False when not launched.

    After `leave()` it joins a new group of the same ranks, through the old group's store: every rank left when a
    fit failed, so all of them meet again at their next fit (a script whose every rank caught the error goes on)."""
    if dist.is_initialized():
        _teardown_at_exit()  # a group the script made itself (torch's init_process_group) too
        return True
    if not launched():
        return False
    dev = bind_device()
    timeout = os.environ.get(TIMEOUT_ENV)
    options = {"timeout": timedelta(seconds=float(timeout))} if timeout else {}
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        options["device_id"] = dev
    if _left is None:
        _join(backend, options)
        _teardown_at_exit()
    else:
        store, world_size, times = _left
        os.environ["WORLD_SIZE"] = str(world_size)
        dist.init_process_group(backend, store=dist.PrefixStore(f"ddipp-rejoin{times}", store), rank=rank(),
                                world_size=world_size, **options)
    return True


def _join(backend: str, options: dict) -> None:
    """Join the launcher's group through its store, under a prefix naming this attempt: torch's static rendezvous
    (ddipp.launch's) keeps one store for every restart of the group, and a restarted group would otherwise read the
    keys of the attempt before (dial its dead ranks' addresses, or wait on keys that attempt used up). A group that does
    not form within the timeout raises an error naming the ranks that never came."""
    global _launch_id
    timeout = options.get("timeout", default_pg_timeout)
    store, me, size = next(dist.rendezvous("env://", timeout=timeout))
    _launch_id = agree_launch_id(store)
    attempt = os.environ.get(ATTEMPT_ENV, "0")
    store = dist.PrefixStore(f"ddipp-attempt{attempt}", store)
    store.set(f"came/{me}", "")
    try:
        dist.init_process_group(backend, store=store, rank=me, world_size=size, **options)
    except dist.DistError as e:
        absent = [rank for rank in range(size) if not store.check([f"came/{rank}"])]
        if absent:
            raise RuntimeError(_never_came(attempt, timeout, absent)) from e
        raise


def _never_came(attempt: str, timeout: timedelta, absent: list[int]) -> str:
    """Why the group of `attempt` did not form: the ranks `absent` never came to join it within `timeout`."""
    ranks = f"rank{'s' * (len(absent) > 1)} {', '.join(map(str, absent))}"
    return (f"ddipp: the group of attempt {attempt} did not form within {timeout.total_seconds():g} s: {ranks} never "
            f"came to join it (still loading, or stuck before it joins; the launcher printed where each rank logs)")


_left = None  # after leave(): (the old group's store, its size, how many times this process left)
_launch_id = None  # this launch's id, once the group formed (agree_launch_id)
LAUNCH_ID_KEY = "ddipp/launch-id"


def agree_launch_id(store) -> str:
    """The id every rank of this launch reads from the launcher's `store`, which torch elastic keeps across its
    restarts (a new launch has a new store): the first rank to ask sets it. Older torch hands each attempt's ranks
    the store under a prefix of the attempt: the id is read beneath it."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.compare_set(LAUNCH_ID_KEY, "", uuid.uuid4().hex).decode()


def launch_id():
    """This launch's id, the same on every rank and node and across its restarts; None before this process joined a
    launched group."""
    return _launch_id


def leave() -> None:
    """Leave the process group at once after a failure, so that the other ranks' collectives with this one fail
    now instead of at the timeout; until `init()` joins again this process runs alone (fastai reads WORLD_SIZE)."""
    global _left
    if not dist.is_initialized():
        return
    store, world_size = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    if dist.get_backend() == "nccl":  # NCCL's way to drop a communicator with work in flight
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    _left = store, world_size, 0 if _left is None else _left[2] + 1
    os.environ["WORLD_SIZE"] = "1"


def leave_after(error: BaseException) -> None:
    """`leave()` after a fit raised `error`. This rank's own error is posted first, to the group's store and to the
    launcher (torch elastic's error file); a peer's failure gets a note naming the rank that failed first and its error
    (its own log may end before it is written), and ends the script, if nothing catches it, with one line saying so
    instead of its traceback."""
    if not dist.is_initialized():
        return
    store, me, times = dist.distributed_c10d._get_default_store(), dist.get_rank(), 0 if _left is None else _left[2] + 1
    if peer_failure(error):
        _stopped_by_peer(error, me, _first_posted(store, me, times))
    else:
        said = "".join(traceback.format_exception_only(error)).strip()
        _tell_launcher(error, said.splitlines()[0])  # first: once the peers learn it, the launcher may stop this rank
        store.set(f"ddipp-error{times}/{me}", said)
    leave()


def _first_posted(store: dist.Store, me: int, times: int) -> tuple[int, str] | None:
    """The lowest rank but `me` that posted its error when the group was left the `times`-th time, and that error."""
    for rank in range(dist.get_world_size()):
        if rank != me and store.check([key := f"ddipp-error{times}/{rank}"]):
            return rank, store.get(key).decode()
    return None


def _stopped_by_peer(error: BaseException, me: int, failed: tuple[int, str] | None) -> None:
    """Note on `error` which rank failed first, with what, and have `error` end the script in one line saying so."""
    if failed:
        add_note(error, f"ddipp: this rank stopped because rank {failed[0]} failed, with:\n{failed[1]}")
        line = f"rank {me} stopped because rank {failed[0]} failed ({failed[1].splitlines()[0]})"
    else:
        add_note(error, "ddipp: this rank stopped because another rank failed; that rank's error is the one to read")
        line = f"rank {me} stopped because another rank failed"
    sys.excepthook = _in_one_line(error, line, sys.excepthook)


def _in_one_line(error: BaseException, line: str, hook):
    """Python's hook for the error that ends a script: `error` said as `line`, in torch elastic's error file where the
    launcher gave one (ddipp.launch prints it after the failed rank's error, the traceback stays in the file), else on
    stderr; any other error as `hook` says it."""
    def say(kind, value, tb):
        if value is not error:
            hook(kind, value, tb)
        elif not os.environ.get(ERROR_FILE_ENV):
            print(f"ddipp: {line}", file=sys.stderr, flush=True)
        else:
            _tell_launcher(error, line, peer_failure=True)
    return say


def _tell_launcher(error: BaseException, line: str, peer_failure: bool = False) -> None:
    """Write `error` to torch elastic's error file of this rank, where the launcher gave one: `line` and its traceback
    (ddipp.launch reads them when the rank ended without a word; `peer_failure`: a peer's failure stopped it)."""
    file = os.environ.get(ERROR_FILE_ENV)
    if file:
        stack = "".join(traceback.format_exception(error))
        told = json.dumps({PEER_FAILURE_KEY: peer_failure, "message": {
            "message": line, "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}})
        with replacing(Path(file)) as f:  # whole or absent: the agent json-loads it once this rank ended
            f.write(told.encode())


class StopRequested(KeyboardInterrupt):
    """Raised on every rank at the same step once `request_stop()` was called on one of them (a notebook's interrupt):
    a KeyboardInterrupt, so fastai ends the fit as on Ctrl-C, with what was trained so far."""


_stop_requested = False


def request_stop(requested: bool = True) -> None:
    """Ask this rank's fit to stop (DistributedCallback passes it on to every rank with the step's loss)."""
    global _stop_requested
    _stop_requested = requested


def stop_requested() -> bool:
    return _stop_requested


def peer_failure(error: BaseException) -> bool:
    """True for the error a collective raises when another rank failed or left (not a problem of this rank)."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and any(
        sign in str(error) for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")))


def teardown() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


_at_exit = False  # teardown is registered to run at the interpreter's exit


def _teardown_at_exit() -> None:
    """Have the interpreter's exit leave the process group (teardown), once: a gloo group still there when the
    interpreter ends can abort a rank that finished its work (SIGABRT, "terminate called without an active
    exception")."""
    global _at_exit
    if not _at_exit:
        atexit.register(teardown)
        _at_exit = True


def barrier() -> None:
    """Wait until every rank gets here; returns at once when not launched."""
    if world_size() > 1 and init():
        dist.barrier()
