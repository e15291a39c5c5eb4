"""What `ddipp.Recompute` saves and costs on a convnet, fastai v2: the bytes autograd keeps for backward in a training
step, counted exactly, and the seconds a step takes, with and without it, at 3 batch sizes, in one plain process and
launched on 2 CPU ranks (`python -m ddipp.launch --nproc 2`, DDP on gloo), one thread each; beside them the largest
difference in every parameter and BatchNorm buffer between the two fits (Recompute's bar: 0.0). Writes the "Recompute"
section of benchmarks/README.md and benchmarks/results/recompute.json.

    make recompute            # from the repository root: .venv2 set up, then this (about 3 minutes on 2 cores)
    python benchmarks/recompute.py --report   # the README section again from benchmarks/results/recompute.json

The model: fastai's `create_vision_model(resnet18, n_out=10, pretrained=False)` (torchvision's resnet18 as the body,
fastai's head with BatchNorm1d and dropout; 11.7M parameters), on generated 3x64x64 images (classes from a fixed
random linear map), fastai's Adam, shuffled batches, 6 steps a rank, one epoch a fit. Recompute takes its default
blocks: the body's conv1 and bn1, each of layer1 to layer4 whole, and the head's BatchNorm1d and Linear layers. A
callback counts a step's bytes with `torch.autograd.graph.saved_tensors_hooks` from before its forward to after its
backward: the distinct storages of the tensors autograd saves, less the parameters' own (held anyway). Seconds: from
before the forward to after the optimizer step, the first step of each fit left out; every fit runs twice, the two
interleaved (plain first, then Recompute first).
"""
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from memory import write_readme

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv2" / "bin" / "python"
LOCK = "/tmp/ddipp-run.lock"  # the shared CPU lock, taken around each run
SIZES, STEPS, ROUNDS, LR, N_VALID, CLASSES = (16, 32, 64), 6, 2, 1e-3, 32, 10
MODES = {"one process": 1, "launched": 2}  # name: processes
VARIANTS = ("plain", "Recompute")
SECTION = "## Recompute (benchmarks/recompute.py)"  # README.md's section this script writes; throughput.py keeps it
BEFORE = "## On a GPU host"  # where the section goes the first time


def learner(bs: int, procs: int, meter, recompute: bool):
    """The same learner for a batch size every time (data, initial weights, loader order)."""
    import torch
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.vision.all import create_vision_model, resnet18
    from torch import nn
    from torch.utils.data import TensorDataset
    import ddipp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(bs * STEPS * procs + N_VALID, 3, 64, 64, generator=g)
    y = (x.flatten(1) @ torch.randn(3 * 64 * 64, CLASSES, generator=g)).argmax(1)
    train, valid = TensorDataset(x[N_VALID:], y[N_VALID:]), TensorDataset(x[:N_VALID], y[:N_VALID])
    random.seed(0)  # a fastai DataLoader seeds its shuffling from Python's generator
    torch.manual_seed(0)
    dls = DataLoaders(DataLoader(train, bs=bs, shuffle=True, drop_last=True), DataLoader(valid, bs=N_VALID),
                      device="cpu")
    model = create_vision_model(resnet18, n_out=CLASSES, pretrained=False)
    cbs = [meter] + ([ddipp.Recompute()] if recompute else [])
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=cbs)
    return learn.to_ddp() if procs > 1 else learn


def meter_callback():
    """A fastai callback counting each training step's bytes saved for backward (parameters excluded) and timing it."""
    import torch
    from fastai.callback.core import Callback

    class Meter(Callback):
        order = 0  # after Recompute (-7) and ddipp's DistributedCallback (-5) changed the model

        def before_fit(self):
            self.saved, self.seconds, self.hooks = [], [], None

        def before_batch(self):
            if not self.training:
                return
            params = {p.untyped_storage().data_ptr() for p in self.learn.model.parameters()}
            storages = self.storages = {}

            def pack(t):
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    storages[storage.data_ptr()] = storage.nbytes()
                return t
            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.hooks.__enter__()
            self.started = time.perf_counter()

        def after_backward(self):
            self.hooks.__exit__(None, None, None)
            self.hooks = None
            self.saved.append(sum(self.storages.values()))

        def after_step(self):
            self.seconds.append(time.perf_counter() - self.started)
    return Meter()


def state(learn) -> dict:
    """The model's parameters and buffers after the fit, by name, in float64."""
    return {name: t.detach().double().clone() for name, t in learn.model.state_dict().items()}


def largest_differences(a: dict, b: dict, params: set) -> dict:
    """max |a - b| over the parameters, and over the BatchNorm buffers (running_mean, running_var,
    num_batches_tracked)."""
    diff = {name: float((a[name] - b[name]).abs().max()) if a[name].numel() else 0.0 for name in a}
    return dict(params=max(v for k, v in diff.items() if k in params),
                buffers=max(v for k, v in diff.items() if k not in params),
                buffers_compared=sum(1 for k in diff if k not in params))


def rank_run(procs: int, out: Path) -> None:
    """One process's (or rank's) fits: each batch size with and without Recompute, ROUNDS times; writes
    out/rank<rank>.json."""
    import torch
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    got = {}
    for bs in SIZES:
        runs = {variant: [] for variant in VARIANTS}
        states = {}
        for round_ in range(ROUNDS):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                meter = meter_callback()
                learn = learner(bs, procs, meter, recompute=variant == "Recompute")
                learn.fit(1, LR)
                runs[variant].append(dict(saved=meter.saved, seconds=meter.seconds[1:]))
                states.setdefault(variant, []).append(state(learn))
        params = {name for name, _ in learn.model.named_parameters()}
        exact = [largest_differences(p, r, params) for p, r in zip(states["plain"], states["Recompute"])]
        got[bs] = dict(runs=runs, exact=dict(params=max(e["params"] for e in exact),
                                             buffers=max(e["buffers"] for e in exact),
                                             buffers_compared=exact[0]["buffers_compared"]))
    (out / f"rank{rank}.json").write_text(json.dumps(dict(rank=rank, procs=procs, sizes=got)))


def run_one(mode: str, out: Path = Path("/tmp/ddipp-bench-recompute")) -> dict:
    """One run (a plain process, or a launch of 2 ranks) under the CPU lock: what each rank measured, and the seconds
    it held the lock."""
    procs = MODES[mode]
    out.mkdir(exist_ok=True)
    for stale in out.glob("rank*.json"):
        stale.unlink()
    locked = out / "locked"  # when the lock was taken: the run's own seconds, without waiting for others' runs
    start = [str(PYTHON)] + (["-m", "ddipp.launch", "--nproc", str(procs)] if procs > 1 else [])
    cmd = ["flock", LOCK, "sh", "-c", 'date +%s.%N >"$0" && exec "$@"', str(locked), *start, __file__,
           "--rank-of", str(procs), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    took = time.time() - float(locked.read_text())
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) < procs:
        sys.exit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(ranks=ranks, took=took)


def row(mode: str, bs: int, ranks: list) -> dict:
    """One table row: the largest rank's bytes, the median seconds a step over every rank's steps, the exactness."""
    per = [r["sizes"][str(bs)] for r in ranks]
    saved = {v: max(s for p in per for run in p["runs"][v] for s in run["saved"]) for v in VARIANTS}
    steady = {v: {s for p in per for run in p["runs"][v] for s in run["saved"]} for v in VARIANTS}
    seconds = {v: statistics.median(s for p in per for run in p["runs"][v] for s in run["seconds"]) for v in VARIANTS}
    return dict(mode=mode, procs=MODES[mode], bs=bs, saved=saved, same_every_step={v: len(steady[v]) == 1
                                                                                   for v in VARIANTS},
                seconds=seconds, params=max(p["exact"]["params"] for p in per),
                buffers=max(p["exact"]["buffers"] for p in per), buffers_compared=per[0]["exact"]["buffers_compared"])


def table(rows: list) -> str:
    lines = ["| fastai | mode | ranks | batch a rank | saved for backward MB/rank, plain | with Recompute | ratio | "
             "s/step plain | with Recompute | cost | max \\|Δ\\| parameters | max \\|Δ\\| BatchNorm buffers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain, rec = r["saved"]["plain"], r["saved"]["Recompute"]
        sp, sr = r["seconds"]["plain"], r["seconds"]["Recompute"]
        lines.append(f"| v2 | {r['mode']} | {r['procs']} | {r['bs']} | {plain / 1e6:.1f} | {rec / 1e6:.1f} | "
                     f"{rec / plain:.3f} | {sp:.3f} | {sr:.3f} | {(sr / sp - 1) * 100:+.0f} % | {r['params']:.1e} | "
                     f"{r['buffers']:.1e} |")
    return "\n".join(lines)


def section(said: dict) -> str:
    rows = said["rows"]
    exact = all(r["params"] == 0 and r["buffers"] == 0 for r in rows)
    steady = all(all(r["same_every_step"].values()) for r in rows)
    doc = __doc__.split(chr(10) + chr(10))
    return f"""{SECTION}

{doc[0].strip()}

    {doc[1].strip()}

{doc[2].strip()}

Machine: {said['cores']} CPU cores, no GPU; the runs held the CPU lock {said['seconds'] / 60:.1f} minutes in all. MB =
10^6 bytes, the largest rank's largest step (every step's count {'was the same' if steady else 'was not the same'});
s/step: the median over both rounds and every rank; cost: Recompute's seconds a step over plain's. The differences
are over both rounds' pairs of fits and every rank ({rows[0]['buffers_compared']} BatchNorm buffers).

{table(rows)}

What these say:

{said_lines(rows, exact)}
"""


STEM_BYTES_AN_ITEM = 3 * 64 * 64 * 4 + 2 * 64 * 32 * 32 * 4 + 64 * 16 * 16 * 8  # see said_lines


def said_lines(rows: list, exact: bool) -> str:
    """What the table says, as the section's bullets."""
    ratios = [r["saved"]["Recompute"] / r["saved"]["plain"] for r in rows]
    costs = [r["seconds"]["Recompute"] / r["seconds"]["plain"] - 1 for r in rows]
    stem = ", ".join(f"{STEM_BYTES_AN_ITEM * bs / 1e6:.1f} MB at {bs}" for bs in SIZES)
    lines = [
        f"Recompute keeps {min(ratios):.3f}–{max(ratios):.3f} of the bytes a plain step saves for backward, at every "
        "batch size, in one process and on each DDP rank alike (the bytes grow with the batch a rank takes, not with "
        "the ranks). Most of what it keeps is the stem's, at 32x32 and 16x16 before layer1: conv1 and bn1 are "
        "blocks of their own, each keeping its input (the image, conv1's output), and relu and maxpool, which have no "
        "parameters, are not recomputed (bn1's output, maxpool's int64 indices): " + stem + ". layer1 to layer4 "
        "keep only their inputs.",
        "These are the bytes kept from the forward until backward; in backward each recomputed block's activations "
        "exist again while its gradients are computed, one block at a time.",
        f"It costs one more forward of the recomputed blocks in backward: {min(costs) * 100:+.0f} % to "
        f"{max(costs) * 100:+.0f} % a step here.",
        "Parameters and every BatchNorm buffer (running_mean, running_var, num_batches_tracked) are bitwise those of "
        "the fit without it (0.0), the head's dropout included, where plain torch.utils.checkpoint of a block with "
        "BatchNorm counts its batches twice (issue 44, pytorch#96136)." if exact else "**Not exact**: see the table."]
    return "\n".join(textwrap.fill(line, 120, initial_indent="- ", subsequent_indent="  ") for line in lines)


def main() -> None:
    said = dict(cores=len(os.sched_getaffinity(0)), rows=[], seconds=0.0)
    for mode in MODES:
        run = run_one(mode)
        said["seconds"] += run["took"]
        said["rows"] += [row(mode, bs, run["ranks"]) for bs in SIZES]
        print(mode, said["rows"][-len(SIZES):], flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(said, indent=2) + "\n")
    report(said)


RESULTS = ROOT / "benchmarks" / "results" / "recompute.json"


def report(said: dict) -> None:
    """The README section from the measured runs; fails when Recompute saved no bytes or was not exact."""
    text = section(said)
    write_readme(text, SECTION, BEFORE)
    print(text)
    wrong = [r for r in said["rows"] if r["params"] or r["buffers"] or r["saved"]["Recompute"] >= r["saved"]["plain"]]
    if wrong:
        sys.exit(f"not as the benchmark expects: {wrong}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-of"]:
        rank_run(int(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["--report"]:  # the README section again from benchmarks/results/recompute.json
        report(json.loads(RESULTS.read_text()))
    else:
        main()
