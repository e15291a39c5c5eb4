"""Run a training script as one process per GPU (or N CPU processes), on torch's elastic launcher.

Usage::

    # one process per listed GPU: local rank i runs on the i-th GPU given, in that order
    python -m ddipp.launch --gpus 3,1 train.py --epochs 4
    python -m ddipp.launch --gpus all train.py          # the default when the host has GPUs

    # N CPU processes with the gloo backend (try DDP on a laptop, or test without GPUs)
    python -m ddipp.launch --nproc 2 train.py

    # two hosts: run once on each; --master-addr is where node rank 0 runs
    python -m ddipp.launch --nnodes 2 --node-rank 0 --master-addr node0 --gpus all train.py
    python -m ddipp.launch --nnodes 2 --node-rank 1 --master-addr node0 --gpus all train.py

    # restart the whole group up to 3 times when a rank fails
    python -m ddipp.launch --max-restarts 3 --gpus all train.py

Everything after the script is passed to it untouched. Workers get torch elastic's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), ddipp's device list in ``DDIPP_DEVICES`` ("3,1" or
"cpu"), and ``OMP_NUM_THREADS=1`` unless it is set. On one host the rendezvous listens on 127.0.0.1 at a
port the OS picks, so launches running at once never collide.

Only rank 0 prints to the terminal; the other ranks write to per-rank log files whose paths are printed
when the group starts. When a rank fails, the launcher shows the end of its log (its traceback), stops
the other ranks and exits with status 1.
"""
import argparse
import os
import sys
import uuid
from pathlib import Path

PROG = "python -m ddipp.launch"
DEFAULT_MASTER_PORT = 29500  # torchrun's
TAIL_LINES = 40  # lines of a failed rank's log shown on the terminal


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


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _count(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        if not text.isdecimal() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return int(text)
    return parse


def _parser() -> _Parser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--gpus", help="GPUs to run on, one process each, e.g. 3,1 or all (default: all)")
    devices.add_argument("--nproc", type=_count(1), help="run N CPU processes (gloo backend) instead")
    parser.add_argument("--nnodes", type=_count(1), default=1, help="number of hosts (default: 1)")
    parser.add_argument("--node-rank", type=_count(0), default=0, help="this host's rank, 0..nnodes-1")
    parser.add_argument("--master-addr", help="address of the node-rank-0 host (needed with --nnodes > 1)")
    parser.add_argument("--master-port", type=_count(1), help=f"its port (default: {DEFAULT_MASTER_PORT})")
    parser.add_argument("--max-restarts", type=_count(0), default=0,
                        help="restart the group up to this many times when a rank fails (default: 0)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="passed to the script untouched")
    return parser


def _check(parser: _Parser, args: argparse.Namespace) -> None:
    """Reject bad input that needs no GPU count, before torch loads."""
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank}: must be below --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.master_addr:
        parser.error(f"--nnodes {args.nnodes} needs --master-addr HOST, the address of node rank 0")
    if args.master_port is not None and args.master_port > 65535:
        parser.error(f"--master-port {args.master_port}: a port is 1..65535")
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} not found")


def _devices(parser: _Parser, args: argparse.Namespace) -> tuple[int, str]:
    """How many processes to start here, and the device list they get ("3,1" or "cpu")."""
    if args.nproc:
        return args.nproc, "cpu"
    import torch
    count = torch.cuda.device_count()
    if args.gpus is None and count == 0:
        parser.error("no GPU on this host; pass --nproc N to run N CPU processes")
    try:
        gpus = parse_gpus(args.gpus or "all", count)
    except ValueError as e:
        parser.error(f"--gpus {args.gpus}: {e}")
    return len(gpus), ",".join(map(str, gpus))


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, start the group, exit 1 (showing the failed ranks' logs) if a rank fails."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    nproc, devices = _devices(parser, args)

    # imported once the input is known to be good, so bad input fails before torch loads
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .dist import DEVICES_ENV

    class RankLogs(DefaultLogsSpecs):
        """Elastic's per-rank log files; prints their paths each time the group (re)starts."""

        stderrs: dict[int, str] = {}  # local rank -> its stderr log ("" when it prints to the terminal)

        def reify(self, envs):
            dest = super().reify(envs)
            self.stderrs = dest.stderrs
            files = [f"rank {envs[i]['RANK']}: {dest.stdouts[i]} {dest.stderrs[i]}" for i in sorted(envs)
                     if dest.stdouts[i]]
            if files:
                print(f"{PROG}: only rank 0 prints here; logs of the others: {'; '.join(files)}",
                      file=sys.stderr, flush=True)
            return dest

    os.environ[DEVICES_ENV] = devices
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    logs = RankLogs(redirects={i: Std.NONE if args.node_rank == 0 and i == 0 else Std.ALL for i in range(nproc)})
    if args.nnodes > 1 or args.master_addr or args.master_port:  # torchrun's static rendezvous at a fixed address
        rdzv = dict(rdzv_backend="static", rdzv_configs={"rank": args.node_rank}, run_id="none",  # same on all nodes
                    rdzv_endpoint=f"{args.master_addr or '127.0.0.1'}:{args.master_port or DEFAULT_MASTER_PORT}")
    else:  # one host: a c10d store on a port the OS picks
        rdzv = dict(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", run_id=uuid.uuid4().hex)
    config = LaunchConfig(min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=nproc,
                          max_restarts=args.max_restarts, logs_specs=logs, **rdzv)
    try:
        elastic_launch(config, sys.executable)("-u", args.script, *args.script_args)
    except ChildFailedError as e:
        for rank, failure in sorted(e.failures.items()):  # elastic's "first failure" is only to the second
            log = logs.stderrs.get(failure.local_rank)
            if failure.exitcode < 0:
                print(f"{PROG}: rank {rank} stopped ({failure.signal_name()})", file=sys.stderr)
            elif not log:
                print(f"{PROG}: rank {rank} failed (exit code {failure.exitcode}); its output is above",
                      file=sys.stderr)
            else:
                tail = Path(log).read_text(errors="replace").splitlines()[-TAIL_LINES:]
                print(f"{PROG}: rank {rank} failed (exit code {failure.exitcode}); end of {log}:", *tail,
                      sep="\n", file=sys.stderr)
        sys.exit(1)
    except SignalException as e:
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    main()
