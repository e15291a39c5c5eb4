"""The same training under a hand-written torch DDP loop (torchrun), fastai v2's own DDP, and ddipp launched with
fastai v1 and with fastai v2: 1 and 2 CPU processes (gloo, one thread each), a small CNN and a compute-bound variant,
in interleaved rounds. Writes benchmarks/README.md (a table, and throughput.png) and benchmarks/results/throughput.json.

    make benchmark            # from the repository root: sets up both virtualenvs, then runs this with .venv

The task: scikit-learn's digits as 3x32x32 images (the 8x8 pixels repeated), 4314 training items (the 1438 after
the first 359, three times) and 359 validation items (odd: a split in equal parts must pad or drop); batch 64 per
process, 2 epochs of Adam at a constant lr 1e-2 without weight decay (torch's in the loop and fastai v1, fastai's in
v2), rates taken in the second epoch.
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
BS, EPOCHS, LR, ROUNDS, N_VALID = 64, 2, 1e-2, 3, 359
WIDTHS = {"small": (16, 32, 64), "compute-bound": (32, 64, 128)}  # 4x the multiply-adds, 4x the gradient
RUNNERS = {  # name: (fastai version of its virtualenv, how 2 processes start)
    "torch DDP loop": (1, "torchrun"),
    "fastai v2 distrib_ctx": (2, "ddipp.launch"),
    "ddipp, fastai v1": (1, "ddipp.launch"),
    "ddipp, fastai v2": (2, "ddipp.launch"),
}


def digits():
    import torch
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data / 16, dtype=torch.float32).view(-1, 1, 8, 8)
    x = x.repeat_interleave(4, 2).repeat_interleave(4, 3).expand(-1, 3, -1, -1).contiguous()
    y = torch.tensor(d.target)
    return (x[N_VALID:].repeat(3, 1, 1, 1), y[N_VALID:].repeat(3)), (x[:N_VALID], y[:N_VALID])


def cnn(widths):
    import torch
    from torch import nn
    torch.manual_seed(0)
    a, b, c = widths
    return nn.Sequential(nn.Conv2d(3, a, 3, padding=1), nn.ReLU(), nn.Conv2d(a, b, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(b, c, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(c, 10))


class Probe:
    """What a process measures: the time of its first step, its training items and their time in the last epoch, the
    validation items its model evaluates per epoch."""

    def __init__(self, model):
        self.first_step, self.items, self.seconds, self.valid_items = None, 0, 0.0, 0
        model.register_forward_hook(self._count)

    def _count(self, module, args, output):
        if not module.training:
            self.valid_items += args[0].shape[0]

    def step_done(self, epoch: int, n: int, started: float) -> None:
        """A training step of `n` items in `epoch`, which began at `started` (time.perf_counter)."""
        self.first_step = self.first_step or time.time()
        if epoch == EPOCHS - 1:
            self.items, self.seconds = self.items + n, time.perf_counter() - started

    def result(self, accuracy: float) -> dict:
        return dict(first_step=self.first_step, items=self.items, seconds=self.seconds,
                    valid_items=self.valid_items // EPOCHS, accuracy=accuracy,
                    peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def torch_loop(widths) -> dict:
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
    ts = DistributedSampler(train, shuffle=True, seed=0, drop_last=True) if launched else None
    vs = DistributedSampler(valid, shuffle=False) if launched else None
    tl = DataLoader(train, BS, sampler=ts, shuffle=not launched, drop_last=True)
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
            probe.step_done(epoch, len(y), started)
        net.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in vl:
                correct += torch.tensor([float((net(x).argmax(1) == y).sum()), float(len(y))])
        if launched:
            dist.all_reduce(correct)
    return probe.result(float(correct[0] / correct[1]))


def fastai_learner(version: int, widths, world: int):
    """A fastai Learner of the task (batch BS a process) with a Probe callback; (learner, probe)."""
    import torch
    from torch import nn
    (xt, yt), (xv, yv) = digits()
    model = cnn(widths)
    probe = Probe(model)
    if version == 1:
        from fastai.basic_data import DataBunch
        from fastai.basic_train import Learner, LearnerCallback
        from fastai.metrics import accuracy
        from torch.utils.data import TensorDataset
        data = DataBunch.create(TensorDataset(xt, yt), TensorDataset(xv, yv), bs=BS, num_workers=0, device="cpu")
        learn = Learner(data, model, loss_func=nn.CrossEntropyLoss(), metrics=[accuracy], opt_func=torch.optim.Adam,
                        wd=0, true_wd=False, bn_wd=False)

        class Timing(LearnerCallback):
            def on_epoch_begin(self, epoch, **kwargs):
                self.epoch, self.started = epoch, time.perf_counter()

            def on_batch_end(self, train, last_target, **kwargs):
                if train:
                    probe.step_done(self.epoch, len(last_target), self.started)
        learn.callbacks.append(Timing(learn))
        return learn, probe
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.metrics import accuracy
    from fastai.optimizer import Adam
    from torch.utils.data import TensorDataset
    dls = DataLoaders(DataLoader(TensorDataset(xt, yt), bs=BS, shuffle=True, drop_last=True),
                      DataLoader(TensorDataset(xv, yv), bs=BS), device="cpu")

    class Timing(Callback):
        def before_train(self):
            self.started = time.perf_counter()

        def after_batch(self):
            if self.training:
                probe.step_done(self.epoch, len(self.yb[0]), self.started)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, cbs=Timing(),
                    opt_func=Adam, wd=0)
    torch.manual_seed(0)
    return learn, probe


def fastai_run(runner: str, widths) -> dict:
    version = RUNNERS[runner][0]
    if runner.startswith("ddipp"):
        import ddipp  # noqa: F401 (Learner.to_ddp)
    world = int(os.environ.get("WORLD_SIZE", 1))
    learn, probe = fastai_learner(version, widths, world)
    if runner == "fastai v2 distrib_ctx" and world > 1:
        import fastai.distributed
        fastai.distributed.DistributedDL._broadcast = _broadcast_on_cpu
        with learn.distrib_ctx(sync_bn=False, cpu=True):
            learn.fit(EPOCHS, LR)
    else:
        learn = learn.to_ddp() if runner.startswith("ddipp") else learn
        learn.fit(EPOCHS, LR)
    values = learn.recorder.metrics[-1] if version == 1 else learn.recorder.values[-1][2:]
    return probe.result(float(values[0]))


def _broadcast_on_cpu(self, t, rank):
    """fastai's DistributedDL._broadcast with a CPU tensor: gloo has no CUDA tensors (fastai's calls .cuda())."""
    import torch
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()


def run_one(runner: str, workload: str, procs: int, out: Path) -> dict:
    """Start the runner on `procs` processes; what each rank measured (its results file), with the start time."""
    version, launcher = RUNNERS[runner]
    cmd = [str(VENV[version])]
    if procs > 1:
        cmd += (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
                if launcher == "torchrun" else ["-m", "ddipp.launch", "--nproc", str(procs)])
    cmd += [__file__, "--rank-of", runner, workload, str(out)]
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
    """ROUNDS interleaved rounds of every runner, workload and process count: {key: [summary per round]}."""
    runs = {}
    for _ in range(ROUNDS):
        for workload in WIDTHS:
            for runner in RUNNERS:
                for procs in (1, 2):
                    key = f"{runner}|{workload}|{procs}"
                    runs.setdefault(key, []).append(summary(run_one(runner, workload, procs, out)))
                    print(key, runs[key][-1], flush=True)
    return runs


def median(runs: list, name: str) -> float:
    return statistics.median(r[name] for r in runs)


def table(runs: dict) -> str:
    rows = ["| workload | runner | samples/s, 1 process | samples/s, 2 processes (range) | scaling efficiency | "
            "call → first step, 2 processes | peak RSS per rank, 1 / 2 processes (MB) | validation items counted "
            "(set: 359) | final accuracy, 2 processes |", "|---|---|---|---|---|---|---|---|---|"]
    for workload in WIDTHS:
        for runner in RUNNERS:
            one, two = runs[f"{runner}|{workload}|1"], runs[f"{runner}|{workload}|2"]
            rates = sorted(r["samples_per_s"] for r in two)
            rows.append(f"| {workload} | {runner} | {median(one, 'samples_per_s'):.0f} | {rates[len(rates) // 2]:.0f} "
                        f"({rates[0]:.0f}–{rates[-1]:.0f}) | "
                        f"{median(two, 'samples_per_s') / (2 * median(one, 'samples_per_s')):.2f} | "
                        f"{median(two, 'to_first_step_s'):.1f} s | {median(one, 'peak_rss_mb'):.0f} / "
                        f"{median(two, 'peak_rss_mb'):.0f} | {two[0]['valid_items']} | {median(two, 'accuracy'):.4f} |")
    return "\n".join(rows)


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
    fig, axes = plt.subplots(1, len(WIDTHS), figsize=(11, 4))
    for ax, workload in zip(axes, WIDTHS):
        names = list(RUNNERS)
        for i, procs in enumerate((1, 2)):
            ax.bar([j + 0.4 * i for j in range(len(names))],
                   [median(runs[f"{n}|{workload}|{procs}"], "samples_per_s") for n in names], 0.4,
                   label=f"{procs} process{'es' if procs > 1 else ''}")
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{workload} CNN: samples/s (median of {ROUNDS})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    out = Path("/tmp/ddipp-bench-throughput")
    out.mkdir(exist_ok=True)
    runs = measure(out)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "throughput.json").write_text(json.dumps(runs, indent=2) + "\n")
    plot(runs, ROOT / "benchmarks" / "throughput.png")
    cores = len(os.sched_getaffinity(0))
    readme = ROOT / "benchmarks" / "README.md"
    readme.write_text(f"""# Benchmarks

## Throughput: `make benchmark` (benchmarks/throughput.py)

{__doc__.split(chr(10) + chr(10))[0].strip()}

Machine: {cores} CPU cores, no GPU; {ROUNDS} interleaved rounds, medians (the range of the 2-process rates in
brackets). Scaling efficiency: samples/s of 2 processes over twice that of 1. Call → first step: from starting the
command to the first training step of any rank (interpreter, imports, group, data). Peak RSS: the largest rank's.
Validation items counted: the items the models' forward passes evaluated in the last validation, all ranks together.

{table(runs)}
{_crashes(runs)}
![samples/s](throughput.png)
""")
    print(readme.read_text())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-of"]:
        runner, workload, out = sys.argv[2], sys.argv[3], Path(sys.argv[4])
        import torch
        torch.set_num_threads(1)
        widths = WIDTHS[workload]
        got = torch_loop(widths) if runner == "torch DDP loop" else fastai_run(runner, widths)
        (out / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(got))
    else:
        main()
