"""Run a training script as one process per GPU (or N CPU processes), on torch's elastic launcher.

Usage::

    # one process per listed GPU: local rank i runs on the i-th GPU given, in that order
    python -m ddipp.launch --gpus 3,1 train.py --epochs 4
    python -m ddipp.launch --gpus all train.py          # the default when the host has GPUs

    # N CPU processes with the gloo backend (try DDP on a laptop, or test without GPUs)
    python -m ddipp.launch --nproc 2 train.py

    # a collective that waits more than 120 s for the other ranks fails (default: 600, as to_ddp's)
    python -m ddipp.launch --timeout 120 --gpus all train.py

    # two hosts on a trusted network: run once on each; --master-addr is where node rank 0 runs
    python -m ddipp.launch --nnodes 2 --node-rank 0 --master-addr node0 --gpus all train.py
    python -m ddipp.launch --nnodes 2 --node-rank 1 --master-addr node0 --gpus all train.py

    # restart the whole group up to 3 times when a rank fails
    python -m ddipp.launch --max-restarts 3 --gpus all train.py

Everything after the script is passed to it untouched. Workers get torch elastic's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), ddipp's device list in ``DDIPP_DEVICES`` ("3,1" or
"cpu"), ``--timeout`` in ``DDIPP_TIMEOUT``, and, unless it is set, ``OMP_NUM_THREADS``: the host's cores divided by
the processes on it (at least 1); a fastai loader with fastai's default worker processes (one per core) gets as many.

On one host nothing listens beyond loopback: the rendezvous is torch's static one (no pickles), on a store
served from a socket ddipp binds to 127.0.0.1 at a port the OS picks (or ``--master-port``), so launches
running at once never collide; gloo and NCCL are kept on the loopback interface (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``, unless set). With ``--nnodes`` > 1, node rank 0's store listens at
``--master-port`` (default 29500) on every interface, and the ranks' gloo/NCCL sockets on the address
their host name resolves to: whoever reaches those ports can read and write the keys the ranks exchange
and join the collectives, without authentication, so run such jobs only on a trusted network.

Only rank 0 prints to the terminal; the other ranks write to per-rank log files whose paths are printed
when the group starts. When a rank fails, the launcher shows the end of its log (its traceback), then a line for each
rank stopped with it, stops the other ranks and exits with the status the failed ranks exited with (a scheduler's
requeue code) when they agree, else 1, keeping the logs; when every rank exits 0 the logs are removed.
"""
import argparse
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from .core.store import LOOPBACK, loopback_listener

PROG = "python -m ddipp.launch"
DEFAULT_MASTER_PORT = 29500  # torchrun's
DEFAULT_TIMEOUT = 600  # seconds, as to_ddp(timeout=600)
LOOPBACK_RENDEZVOUS = "ddipp-loopback"  # the elastic rendezvous backend of a one-host launch
TAIL_LINES = 40  # lines of a failed rank's log shown on the terminal


class BadInput(ValueError):
    """A command line the launcher refuses; the message names the value and the fix."""


def _refuse(message: str) -> NoReturn:
    """Exit 2 with a one-line error, before any worker starts."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage text."""

    def error(self, message: str) -> NoReturn:
        _refuse(message)


def _count(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        if not text.isdecimal() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return int(text)
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 that a timedelta holds (not inf or nan)."""
    try:
        seconds = float(text)
        timedelta(seconds=seconds)
    except (ValueError, OverflowError):
        seconds = 0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0, e.g. --timeout {DEFAULT_TIMEOUT}")
    return seconds


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (sys.argv's by default) as parsed arguments; exits 2 with one line if they do not parse."""
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--gpus", help="GPUs to run on, one process each, e.g. 3,1 or all (default: all)")
    devices.add_argument("--nproc", type=_count(1), help="run N CPU processes (gloo backend) instead")
    parser.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT,
                        help=f"seconds a collective may wait for the other ranks (default: {DEFAULT_TIMEOUT})")
    parser.add_argument("--nnodes", type=_count(1), default=1, help="number of hosts (default: 1)")
    parser.add_argument("--node-rank", type=_count(0), default=0, help="this host's rank, 0..nnodes-1")
    parser.add_argument("--master-addr", help="address of the node-rank-0 host (only with --nnodes > 1)")
    parser.add_argument("--master-port", type=_count(1),
                        help=f"its store's port (default: {DEFAULT_MASTER_PORT}; on one host a free port)")
    parser.add_argument("--max-restarts", type=_count(0), default=0,
                        help="restart the group up to this many times when a rank fails (default: 0)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="passed to the script untouched")
    return parser.parse_args(argv)


@dataclass
class Config:
    """A launch as data: what runs on this host, where node rank 0's store listens, what ddipp adds to the workers'
    environment."""

    script: str
    script_args: list[str]
    nproc: int  # processes on this host
    nnodes: int
    node_rank: int
    master_addr: str  # where the store listens; on one host 127.0.0.1
    master_port: int  # 0: a free port the OS picks
    max_restarts: int
    env: dict[str, str]  # added to the workers' environment


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Config:
    """The launch the parsed command line asks for, in the environment `environ`; BadInput if it cannot be."""
    _check(args)
    nproc, devices = _devices(args)
    one_host = args.nnodes == 1
    return Config(script=args.script, script_args=args.script_args, nproc=nproc, nnodes=args.nnodes,
                  node_rank=args.node_rank, master_addr=LOOPBACK if one_host else args.master_addr,
                  master_port=args.master_port or (0 if one_host else DEFAULT_MASTER_PORT),
                  max_restarts=args.max_restarts, env=worker_env(args, nproc, devices, environ))


def worker_env(args: argparse.Namespace, nproc: int, devices: str, environ: Mapping[str, str] = os.environ) -> dict:
    """What ddipp adds to the workers' environment (the rest is elastic's): ddipp.core.dist.rank_env's."""
    from .core.dist import rank_env  # bad input fails before torch loads

    return rank_env(devices, args.timeout, nproc, args.nnodes == 1, environ)


def _check(args: argparse.Namespace) -> None:
    """Reject bad input that needs no GPU count, before torch loads."""
    if args.node_rank >= args.nnodes:
        raise BadInput(f"--node-rank {args.node_rank}: must be below --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.master_addr:
        raise BadInput(f"--nnodes {args.nnodes} needs --master-addr HOST, the address of node rank 0")
    if args.nnodes == 1 and args.master_addr:
        raise BadInput(f"--master-addr {args.master_addr}: only for --nnodes > 1; "
                       f"one host rendezvouses on {LOOPBACK}, leave it out")
    if args.master_port is not None and args.master_port > 65535:
        raise BadInput(f"--master-port {args.master_port}: a port is 1..65535")
    if not Path(args.script).is_file():
        raise BadInput(f"script {args.script!r} not found")


def _devices(args: argparse.Namespace) -> tuple[int, str]:
    """How many processes to start here, and the device list they get ("3,1" or "cpu")."""
    if args.nproc:
        return args.nproc, "cpu"
    import torch

    from .core.dist import parse_gpus
    count = torch.cuda.device_count()
    if args.gpus is None and count == 0:
        raise BadInput("no GPU on this host; pass --nproc N to run N CPU processes")
    try:
        gpus = parse_gpus(args.gpus or "all", count)
    except ValueError as e:
        raise BadInput(f"--gpus {args.gpus}: {e}") from None
    return len(gpus), ",".join(map(str, gpus))


def store_socket(config: Config) -> socket.socket | None:
    """On one host, the socket the group's store will serve from, listening on 127.0.0.1; on node rank 0 of several,
    None once the port is known to be free for torch's store. BadInput naming a port that cannot be had."""
    if config.nnodes > 1 and config.node_rank > 0:
        return None
    host = LOOPBACK if config.nnodes == 1 else ""  # "": every interface, where torch's store will listen
    try:
        sock = loopback_listener(config.master_port) if host else socket.create_server(("", config.master_port))
    except OSError as e:
        raise BadInput(f"--master-port {config.master_port}: cannot listen on {host or '*'}:{config.master_port} "
                       f"({os.strerror(e.errno)}); pick another port, or leave --master-port out") from None
    if config.nnodes == 1:
        return sock
    sock.close()
    return None


def run(config: Config, listener: socket.socket | None) -> int:
    """Start the group `config` describes and wait for it; the exit status: 0 when every rank exited 0 (their logs are
    then removed), when ranks failed (logs kept, the failed ranks' shown) the status each exited with if they agree,
    else 1, 128+N on signal N. `listener`: see store_socket."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.update(config.env)  # the workers inherit the launcher's environment
    if config.nproc > 1:
        from .core.dist import cores_shared
        print(f"{PROG}: {cores_shared(config.nproc, os.environ['OMP_NUM_THREADS'])}", file=sys.stderr, flush=True)
    logs = _rank_logs(config)
    launch_config = LaunchConfig(min_nodes=config.nnodes, max_nodes=config.nnodes, nproc_per_node=config.nproc,
                                 max_restarts=config.max_restarts, logs_specs=logs, **_rendezvous(config, listener))
    try:
        elastic_launch(launch_config, sys.executable)("-u", config.script, *config.script_args)
    except ChildFailedError as e:
        return _report({**_ended_while_exiting(logs.error_files, e.failures), **e.failures}, logs.stderrs)
    except SignalException as e:
        return 128 + e.sigval
    shutil.rmtree(logs.root_log_dir)
    return 0


def _rendezvous(config: Config, listener: socket.socket | None) -> dict:
    """LaunchConfig's rendezvous arguments: on one host ddipp's loopback rendezvous on `listener`, else torch's static
    rendezvous at --master-addr:--master-port (node rank 0's store listens there on every interface)."""
    if listener is None:
        return dict(rdzv_backend="static", rdzv_configs={"rank": config.node_rank}, run_id="none",  # same on all nodes
                    rdzv_endpoint=f"{config.master_addr}:{config.master_port}")
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)
    host, port = listener.getsockname()
    return dict(rdzv_backend=LOOPBACK_RENDEZVOUS, rdzv_endpoint=f"{host}:{port}", run_id=uuid.uuid4().hex,
                rdzv_configs={"listener": listener})  # the store takes the socket over


def _loopback_rendezvous(params):
    """Elastic's handler for a one-host launch: torch's static rendezvous (no pickled state), its store ddipp's
    loopback store, served from the listener store_socket bound."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from .core.store import loopback_store

    class LoopbackRendezvous(StaticTCPRendezvous):
        def __init__(self, host: str, port: int, run_id: str, timeout: int, listener: socket.socket):
            super().__init__(host, port, rank=0, world_size=1, run_id=run_id, timeout=timeout)
            self._store = loopback_store(listener, self.timeout)

        def get_backend(self) -> str:
            return LOOPBACK_RENDEZVOUS

    host, port = params.endpoint.rsplit(":", 1)
    return LoopbackRendezvous(host, int(port), params.run_id, int(params.config["timeout"]),
                              params.config["listener"])


def _rank_logs(config: Config):
    """Elastic's per-rank log files, in a torchelastic_* temp folder: every rank but rank 0 writes there."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    class RankLogs(DefaultLogsSpecs):
        """Prints the log files' paths each time the group (re)starts."""

        stderrs: dict[int, str] = {}  # local rank -> its stderr log ("" when it prints to the terminal)
        error_files: dict[int, tuple[int, str]] = {}  # local rank -> (its rank, its error file)

        def reify(self, envs):
            dest = super().reify(envs)
            self.stderrs = dest.stderrs
            self.error_files = {i: (int(envs[i]["RANK"]), dest.error_files[i]) for i in envs}
            files = [f"rank {envs[i]['RANK']}: {dest.stdouts[i]} {dest.stderrs[i]}" for i in sorted(envs)
                     if dest.stdouts[i]]
            if files:
                print(f"{PROG}: only rank 0 prints here; logs of the others: {'; '.join(files)}",
                      file=sys.stderr, flush=True)
            return dest

    rank0_here = config.node_rank == 0
    return RankLogs(redirects={i: Std.NONE if rank0_here and i == 0 else Std.ALL for i in range(config.nproc)})


OWN_ERROR, SIGNALLED, STOPPED_BY_PEER = range(3)  # the order _report says failed ranks in


def _report(failures: dict, stderrs: dict[int, str]) -> int:
    """Say which ranks failed: first each one's own error, with the end of its log (elastic's "first failure" is only to
    the second), then in one line each rank stopped by a signal, then each rank stopped by another's failure. Returns
    the launcher's exit status: the one every rank that failed on its own exited with, when they agree, else 1."""
    said = [(*_said(rank, failure, stderrs.get(failure.local_rank)), failure)
            for rank, failure in sorted(failures.items())]
    for _, lines, _ in sorted(said, key=lambda entry: entry[0]):
        print(*lines, sep="\n", file=sys.stderr)
    statuses = {_own_status(order, failure) for order, _, failure in said} - {None}
    return statuses.pop() if len(statuses) == 1 else 1


def _own_status(order: int, failure) -> int | None:
    """The exit status a failed rank (elastic's ProcessFailure, said in `order`) ended with of its own; None for one
    stopped by another's failure (ddipp's peer failure, the launcher's SIGTERM); 1 for one killed by another signal or
    stopped while it exited after raising (Python's status for an error)."""
    if order == STOPPED_BY_PEER or (order == SIGNALLED and failure.exitcode == -signal.SIGTERM):
        return None
    return failure.exitcode if failure.exitcode > 0 else 1


def _ended_while_exiting(error_files: dict[int, tuple[int, str]], failures: dict) -> dict:
    """The ranks elastic left out of `failures` that had raised: a peer they stopped exited first, and elastic ended the
    group (SIGTERM) while they still exited. `error_files`: local rank -> (rank, its error file); rank -> failure."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from .core.dist import PEER_FAILURE_KEY

    ended = {rank: ProcessFailure(local_rank, 0, -signal.SIGTERM, file)  # its pid is not told: 0
             for local_rank, (rank, file) in error_files.items() if rank not in failures and Path(file).is_file()}
    return {rank: failure for rank, failure in ended.items() if not failure.error_file_data.get(PEER_FAILURE_KEY)}


def _said(rank: int, failure, log: str | None) -> tuple[int, list[str]]:
    """What the launcher says of a failed rank (elastic's ProcessFailure) whose stderr went to `log` (empty: to the
    terminal): its place in the report, and the lines."""
    from .core.dist import PEER_FAILURE_KEY

    if failure.error_file_data.get(PEER_FAILURE_KEY):  # its line, written by ddipp.core.dist.leave_after's hook
        return STOPPED_BY_PEER, [f"{PROG}: {failure.message['message']}"]
    tail = Path(log).read_text(errors="replace").splitlines()[-TAIL_LINES:] if log else []
    raised = any("Traceback (most recent call last)" in line for line in tail)  # lines start with "[rankN]: "
    if failure.exitcode < 0 and raised:  # stopped while exiting after its error (a peer's echo ended first)
        return OWN_ERROR, [f"{PROG}: rank {rank} raised and was stopped ({failure.signal_name()}) while it exited; "
                           f"end of {log}:", *tail]
    told = failure.message.get("extraInfo", {}).get("py_callstack") if isinstance(failure.message, dict) else None
    if failure.exitcode < 0 and told:  # stopped before its traceback was printed; it wrote its error file first
        return OWN_ERROR, [f"{PROG}: rank {rank} raised and was stopped ({failure.signal_name()}) while it exited; "
                           f"its error, from {failure.error_file}:", *told.splitlines()[-TAIL_LINES:]]
    if failure.exitcode < 0:
        return SIGNALLED, [f"{PROG}: rank {rank} stopped ({failure.signal_name()})"]
    if not log:
        return OWN_ERROR, [f"{PROG}: rank {rank} failed (exit code {failure.exitcode}); its output is above"]
    return OWN_ERROR, [f"{PROG}: rank {rank} failed (exit code {failure.exitcode}); end of {log}:", *tail]


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, start the group, exit as run() says (showing the failed ranks' logs if a rank fails)."""
    try:
        config = config_from_args(parse(argv))
        listener = store_socket(config)
    except BadInput as e:
        _refuse(str(e))
    sys.exit(run(config, listener))


if __name__ == "__main__":
    main()
