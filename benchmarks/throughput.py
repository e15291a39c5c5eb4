"""The same training under a hand-written torch DDP loop (torchrun), fastai v1's and fastai v2's own DDP, and ddipp
launched and in notebook mode with fastai v1 and v2: 1 and 2 CPU processes (gloo, one thread each), a small CNN and a
compute-bound variant, in interleaved rounds, and ddipp with `split_batches=True`, which must end where one
process ends. Writes benchmarks/README.md (a table, and throughput.png) and
benchmarks/results/throughput.json.

    make benchmark            # from the repository root: sets up both virtualenvs, then runs this with .venv

The task: scikit-learn's digits as 3x32x32 images (the 8x8 pixels repeated), 4314 training items (the 1438 after
the first 359, three times, in one order drawn once: no runner shuffles, so that a split of one process's batches
sees its batches) and 359 validation items (odd: a split in equal parts must pad or drop); batch 64 per process
(with `split_batches=True`, 64 over the 2 processes), 4 epochs of Adam at a constant lr 1e-3 without weight decay
(torch's in the loop and fastai v1, fastai's in v2), rates taken in the last epoch. One process is the loop or plain
fastai of the same version (ddipp's `to_ddp()` does nothing in a plain process); ddipp in notebook mode is
`to_ddp(nprocs=2)` called in a plain process.

fastai's own DDP needs CUDA where ddipp does not; on CPU: fastai v1's `DistributedTrainer` is given a DDP without
`device_ids` (it passes `device_ids=[cuda_id]`, which a CPU model refuses) and its process group is started with
gloo instead of `setup_distrib` (which calls `torch.cuda.set_device`); fastai v2's `DistributedDL._broadcast` gets a
CPU tensor (it calls `.cuda()`).
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = {1: ROOT / ".venv" / "bin" / "python", 2: ROOT / ".venv2" / "bin" / "python"}
BS, EPOCHS, LR, ROUNDS, N_VALID = 64, 4, 1e-3, 5, 359
WIDTHS = {"small": (16, 32, 64), "compute-bound": (32, 64, 128)}  # 4x the multiply-adds, 4x the gradient
RUNNERS = {  # name: (fastai version of its virtualenv, how 2 processes start, the runner of its 1 process)
    "torch DDP loop": (1, "torchrun", "torch DDP loop"),
    "fastai v1 DistributedTrainer": (1, "torchrun", "fastai v1"),
    "ddipp launched, fastai v1": (1, "ddipp.launch", "fastai v1"),
    "ddipp notebook, fastai v1": (1, "notebook", "fastai v1"),
    "fastai v2 distrib_ctx": (2, "torchrun", "fastai v2"),
    "ddipp launched, fastai v2": (2, "ddipp.launch", "fastai v2"),
    "ddipp notebook, fastai v2": (2, "notebook", "fastai v2"),
    "ddipp notebook, fastai v1, split_batches": (1, "notebook", "fastai v1"),
    "ddipp notebook, fastai v2, split_batches": (2, "notebook", "fastai v2"),
}
SINGLE = {"torch DDP loop": 1, "fastai v1": 1, "fastai v2": 2}  # the 1-process runners: fastai version
PER_STEP = "## Per-step accounting"  # README.md's section of per_step.py: report() keeps it and what follows


def digits():
    import torch
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data / 16, dtype=torch.float32).view(-1, 1, 8, 8)
    x = x.repeat_interleave(4, 2).repeat_interleave(4, 3).expand(-1, 3, -1, -1).contiguous()
    y = torch.tensor(d.target)
    order = torch.randperm(3 * (len(y) - N_VALID), generator=torch.Generator().manual_seed(1))
    return (x[N_VALID:].repeat(3, 1, 1, 1)[order], y[N_VALID:].repeat(3)[order]), (x[:N_VALID], y[:N_VALID])


def cnn(widths):
    import torch
    from torch import nn
    torch.manual_seed(0)
    a, b, c = widths
    return nn.Sequential(nn.Conv2d(3, a, 3, padding=1), nn.ReLU(), nn.Conv2d(a, b, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(b, c, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(16 * c, 10))


class Probe:
    """What a process measures: the time of its first step, the training items its model takes and their time in the
    last epoch, the validation items its model evaluates per epoch."""

    def __init__(self, model):
        self.first_step, self.items, self.step_items, self.seconds, self.valid_items = None, 0, 0, 0.0, 0
        model.register_forward_hook(self._count)

    def _count(self, module, args, output):
        if module.training:
            self.step_items += args[0].shape[0]
        else:
            self.valid_items += args[0].shape[0]

    def step_done(self, epoch: int, started: float) -> None:
        """A training step in `epoch`, which began at `started` (time.perf_counter)."""
        self.first_step = self.first_step or time.time()
        if epoch == EPOCHS - 1:
            self.items, self.seconds = self.items + self.step_items, time.perf_counter() - started
        self.step_items = 0

    def result(self, accuracy: float) -> dict:
        return dict(first_step=self.first_step, items=self.items, seconds=self.seconds,
                    valid_items=self.valid_items // EPOCHS, accuracy=accuracy,
                    peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    def write(self, out: Path, accuracy: float) -> None:
        """This process's results file in `out`, named by its rank."""
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"rank{rank}.json").write_text(json.dumps(self.result(accuracy)))


def torch_loop(widths, out: Path) -> None:
    """The loop a user writes from PyTorch's DDP tutorial: DistributedSampler, DDP, an all-reduced accuracy."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("gloo")
    (xt, yt), (xv, yv) = digits()
    model = cnn(widths)
    probe = Probe(model)
    train, valid = TensorDataset(xt, yt), TensorDataset(xv, yv)
    ts = DistributedSampler(train, shuffle=False, drop_last=True) if launched else None
    vs = DistributedSampler(valid, shuffle=False) if launched else None
    tl = DataLoader(train, BS, sampler=ts, drop_last=True)
    vl = DataLoader(valid, BS, sampler=vs)
    net = torch.nn.parallel.DistributedDataParallel(model) if launched else model
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    loss_func = torch.nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        if ts:
            ts.set_epoch(epoch)
        net.train()
        started = time.perf_counter()
        for x, y in tl:
            loss = loss_func(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step_done(epoch, started)
        net.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in vl:
                correct += torch.tensor([float((net(x).argmax(1) == y).sum()), float(len(y))])
        if launched:
            dist.all_reduce(correct)
    probe.write(out, float(correct[0] / correct[1]))


def fastai_learner(version: int, widths, out: Path):
    """A fastai Learner of the task (batch BS a process) whose callback writes what its Probe measured when the fit
    ends, on whichever process the fit runs."""
    import torch
    from torch import nn
    (xt, yt), (xv, yv) = digits()
    model = cnn(widths)
    probe = Probe(model)
    if version == 1:
        from fastai.basic_data import DataBunch
        from fastai.basic_train import Learner, LearnerCallback
        from fastai.metrics import accuracy
        from torch.utils.data import DataLoader, TensorDataset
        data = DataBunch(DataLoader(TensorDataset(xt, yt), BS, drop_last=True), DataLoader(TensorDataset(xv, yv), BS),
                         device="cpu")
        learn = Learner(data, model, loss_func=nn.CrossEntropyLoss(), metrics=[accuracy], opt_func=torch.optim.Adam,
                        wd=0, true_wd=False, bn_wd=False)

        class Timing(LearnerCallback):
            def on_epoch_begin(self, epoch, **kwargs):
                self.epoch, self.started = epoch, time.perf_counter()

            def on_batch_end(self, train, **kwargs):
                if train:
                    probe.step_done(self.epoch, self.started)

            def on_train_end(self, **kwargs):
                probe.write(out, float(self.learn.recorder.metrics[-1][0]))
        learn.callbacks.append(Timing(learn))
        return learn
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.metrics import accuracy
    from fastai.optimizer import Adam
    from torch.utils.data import TensorDataset
    dls = DataLoaders(DataLoader(TensorDataset(xt, yt), bs=BS, drop_last=True),
                      DataLoader(TensorDataset(xv, yv), bs=BS), device="cpu")

    class Timing(Callback):
        def before_train(self):
            self.started = time.perf_counter()

        def after_batch(self):
            if self.training:
                probe.step_done(self.epoch, self.started)

        def after_fit(self):
            probe.write(out, float(self.learn.recorder.values[-1][2]))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, cbs=Timing(),
                    opt_func=Adam, wd=0)
    torch.manual_seed(0)
    return learn


def fastai_run(runner: str, widths, out: Path, prepare=None) -> None:
    """`runner`'s fit of the task; each process that trains writes its results file. `prepare(learn)`, if given, is
    called on the learner before it is made distributed (per_step.py adds its counters' callback)."""
    version = RUNNERS[runner][0] if runner in RUNNERS else SINGLE[runner]
    if runner.startswith("ddipp"):
        import ddipp  # noqa: F401 (Learner.to_ddp)
    learn = fastai_learner(version, widths, out)
    if prepare:
        prepare(learn)
    if runner == "fastai v1 DistributedTrainer":
        import torch.distributed as dist
        import fastai.distributed
        dist.init_process_group("gloo")
        fastai.distributed.DistributedDataParallel = _ddp_on_cpu
        learn.to_distributed(int(os.environ["LOCAL_RANK"]))
    if runner == "fastai v2 distrib_ctx":
        import fastai.distributed
        fastai.distributed.DistributedDL._broadcast = _broadcast_on_cpu
        with learn.distrib_ctx(sync_bn=False, cpu=True):
            learn.fit(EPOCHS, LR)
        return
    if runner.startswith("ddipp launched"):
        learn = learn.to_ddp()
    if runner.startswith("ddipp notebook"):
        learn = learn.to_ddp(nprocs=2, split_batches=runner.endswith("split_batches"))
    learn.fit(EPOCHS, LR)


def _ddp_on_cpu(module, device_ids, output_device):
    """torch's DDP as fastai v1's DistributedTrainer makes it, minus the CUDA device a CPU model refuses."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(module)


def _broadcast_on_cpu(self, t, rank):
    """fastai's DistributedDL._broadcast with a CPU tensor: gloo has no CUDA tensors (fastai's calls .cuda())."""
    import torch
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()


def run_one(runner: str, workload: str, procs: int, out: Path, script: str = __file__) -> dict:
    """Start `runner` (2 processes) or a SINGLE runner (1) with `script`'s `--rank-of` in each; what each process
    measured, with the start time."""
    version, launcher, _ = RUNNERS[runner] if procs > 1 else (SINGLE[runner], None, None)
    cmd = [str(VENV[version])]
    if launcher in ("torchrun", "ddipp.launch"):
        cmd += (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
                if launcher == "torchrun" else ["-m", "ddipp.launch", "--nproc", str(procs)])
    cmd += [script, "--rank-of", runner, workload, str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for stale in out.glob("rank*.json"):
        stale.unlink()
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if len(ranks) < procs:
        sys.exit(f"{runner} ({workload}, {procs}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    # a group whose ranks wrote their results but crashed while exiting (fastai v2's DDP once aborted so) counts
    return dict(started=started, ranks=ranks, exit_code=proc.returncode)


def summary(run: dict) -> dict:
    ranks = run["ranks"]
    return dict(exit_code=run["exit_code"],
                samples_per_s=sum(r["items"] for r in ranks) / max(r["seconds"] for r in ranks),
                to_first_step_s=min(r["first_step"] for r in ranks) - run["started"],
                peak_rss_mb=max(r["peak_rss_mb"] for r in ranks), valid_items=sum(r["valid_items"] for r in ranks),
                accuracy=ranks[0]["accuracy"])


def measure(out: Path) -> dict:
    """ROUNDS interleaved rounds of every runner on 2 processes and every SINGLE runner, for each workload:
    {"runner|workload|processes": [summary per round]}."""
    runs = {}
    for _ in range(ROUNDS):
        for workload in WIDTHS:
            for runner, procs in [(r, 1) for r in SINGLE] + [(r, 2) for r in RUNNERS]:
                key = f"{runner}|{workload}|{procs}"
                runs.setdefault(key, []).append(summary(run_one(runner, workload, procs, out)))
                print(key, runs[key][-1], flush=True)
    return runs


def median(runs: list, name: str) -> float:
    return statistics.median(r[name] for r in runs)


def rates(runs: list) -> tuple:
    """The samples/s of `runs`: median, lowest, highest."""
    got = sorted(r["samples_per_s"] for r in runs)
    return statistics.median(got), got[0], got[-1]


def table(runs: dict) -> str:
    rows = ["| workload | runner | samples/s (range) | vs torch loop | scaling efficiency | "
            "call → first step | peak RSS per rank (MB) | validation items counted (set: 359) | final accuracy |",
            "|---|---|---|---|---|---|---|---|---|"]
    for workload in WIDTHS:
        loop = median(runs[f"torch DDP loop|{workload}|2"], "samples_per_s")
        for runner in SINGLE:
            one = runs[f"{runner}|{workload}|1"]
            rate, low, high = rates(one)
            rows.append(f"| {workload} | {runner}, 1 process | {rate:.0f} ({low:.0f}–{high:.0f}) | | | "
                        f"{median(one, 'to_first_step_s'):.1f} s | {median(one, 'peak_rss_mb'):.0f} | "
                        f"{one[0]['valid_items']} | {median(one, 'accuracy'):.4f} |")
        for runner, (_, _, single) in RUNNERS.items():
            one, two = runs[f"{single}|{workload}|1"], runs[f"{runner}|{workload}|2"]
            rate, low, high = rates(two)
            rows.append(f"| {workload} | {runner} | {rate:.0f} ({low:.0f}–{high:.0f}) | {rate / loop:.2f} | "
                        f"{rate / (2 * median(one, 'samples_per_s')):.2f} | {median(two, 'to_first_step_s'):.1f} s | "
                        f"{median(two, 'peak_rss_mb'):.0f} | {two[0]['valid_items']} | {median(two, 'accuracy'):.4f} |")
    return "\n".join(rows)


def against_own(runs: dict) -> str:
    """Each ddipp row (no split_batches) beside fastai's own DDP of its version: the ratio of medians, and whether the
    two rows' ranges of rates overlap (a difference inside the rounds' spread)."""
    own = {1: "fastai v1 DistributedTrainer", 2: "fastai v2 distrib_ctx"}
    said = []
    for workload in WIDTHS:
        for runner, (version, _, _) in RUNNERS.items():
            if runner.startswith("ddipp") and not runner.endswith("split_batches"):
                (rate, low, high), (theirs, their_low, their_high) = (
                    rates(runs[f"{name}|{workload}|2"]) for name in (runner, own[version]))
                inside = low <= their_high and their_low <= high
                said.append(f"- {workload}, {runner}: {rate / theirs:.2f}× {own[version]}'s samples/s, "
                            f"{'inside' if inside else 'outside'} the rounds' spread")
    return "\n".join(said)


def split_against_one(runs: dict) -> str:
    """Each split_batches row's median accuracy beside its one process's, in validation items apart."""
    said = []
    for workload in WIDTHS:
        for runner, (_, _, single) in RUNNERS.items():
            if runner.endswith("split_batches"):
                keys = f"{runner}|{workload}|2", f"{single}|{workload}|1"
                split, one = (median(runs[key], "accuracy") for key in keys)
                said.append(f"- {workload}, {single}: {split:.4f} split over 2 processes, {one:.4f} in one "
                            f"({round(abs(split - one) * N_VALID)} validation items apart)")
    return "\n".join(said)


def _crashes(runs: dict) -> str:
    """A line on the runs whose processes wrote their results and then crashed while exiting, if any."""
    crashed = [f"{key.replace('|', ', ')} process(es): {sum(r['exit_code'] != 0 for r in got)} of {len(got)} runs"
               for key, got in runs.items() if any(r["exit_code"] != 0 for r in got)]
    return f"\nExited non-zero after writing their results (counted all the same): {'; '.join(crashed)}.\n" if crashed \
        else ""


def plot(runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(WIDTHS), figsize=(12, 4.5))
    bars = [(f"{r}, 1 process", r, 1) for r in SINGLE] + [(r, r, 2) for r in RUNNERS]
    for ax, workload in zip(axes, WIDTHS):
        got = [rates(runs[f"{r}|{workload}|{p}"]) for _, r, p in bars]
        ax.bar(range(len(bars)), [m for m, _, _ in got],
               color=["tab:gray" if p == 1 else "tab:blue" for _, _, p in bars],
               yerr=[[m - low for m, low, _ in got], [high - m for m, _, high in got]], capsize=3)
        ax.set_xticks(range(len(bars)), [name for name, _, _ in bars], rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{workload} CNN: samples/s (median and range of {ROUNDS})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    out = Path("/tmp/ddipp-bench-throughput")
    out.mkdir(exist_ok=True)
    runs = measure(out)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "throughput.json").write_text(json.dumps(runs, indent=2) + "\n")
    report(runs)


def report(runs: dict) -> None:
    """benchmarks/README.md (up to its PER_STEP section) and throughput.png from the measured runs."""
    plot(runs, ROOT / "benchmarks" / "throughput.png")
    cores = len(os.sched_getaffinity(0))
    readme = ROOT / "benchmarks" / "README.md"
    said = readme.read_text() if readme.exists() else ""
    kept = said[said.index(PER_STEP):] if PER_STEP in said else ""
    readme.write_text(f"""# Benchmarks

## Throughput: `make benchmark` (benchmarks/throughput.py)

{(chr(10) * 2).join(p.strip() for i, p in enumerate(__doc__.split(chr(10) + chr(10))) if i != 1)}

Machine: {cores} CPU cores, no GPU; {ROUNDS} interleaved rounds, medians (the range of the rates in brackets). vs
torch loop: samples/s over the torch loop's on 2 processes. Scaling efficiency: samples/s of 2 processes over twice
that of the 1-process row of its kind (the loop, or plain fastai of its version). Call → first step: from
starting the command to the first training step of any rank (interpreter, imports, group or workers, data). Peak RSS:
the largest rank's (for notebook mode, a worker's). Validation items counted: the items the models' forward passes
evaluated in the last validation, all ranks together. Final accuracy, after {EPOCHS} epochs: 2 processes at a batch
of {BS} each take half the steps of one process with twice its batch, so they end elsewhere; a `split_batches` row
takes one process's steps on one process's batches and ends at its accuracy, to the rounding of a gradient summed in
another order, which {EPOCHS} epochs of Adam carry:

{split_against_one(runs)}

Every runner loads in its training processes (num_workers=0), batch {BS} a process, in the order drawn once.
ddipp against fastai's own DDP of the same version (the ranges of two rows overlap: the difference lies inside the
rounds' spread):

{against_own(runs)}

{table(runs)}
{_crashes(runs)}
![samples/s](throughput.png)
""" + (f"\n{kept}" if kept else ""))
    print(readme.read_text())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-of"]:
        runner, workload, out = sys.argv[2], sys.argv[3], Path(sys.argv[4])
        import torch
        torch.set_num_threads(1)
        if runner == "torch DDP loop":
            torch_loop(WIDTHS[workload], out)
        else:
            fastai_run(runner, WIDTHS[workload], out)
    else:
        main()
