"""What each rank holds for parameters, gradients and optimizer state under `to_ddp()` (DDP) and `to_ddp(shard=True)`
at 1, 2 and 3 CPU processes (gloo, one thread each), launched (`python -m ddipp.launch --nproc N`), fastai v2: counted
from the tensors during the fit, beside each rank's peak resident memory and samples/s, in interleaved rounds; then,
under a per-rank budget of those bytes, the largest width that trains under each. Writes the "Memory" section of
benchmarks/README.md and benchmarks/results/memory.json.

    make memory               # from the repository root: .venv2 set up, then this (about 10 minutes on 2 cores)
    python benchmarks/memory.py --report   # the README section again from benchmarks/results/memory.json

The model: an MLP of 5 Linear layers (512 -> W, three W -> W, W -> 10) on generated data (classes from a fixed random
linear map), fastai's Adam (two state tensors a parameter), batch 32 a rank, 4 steps a rank an epoch (the data grows
with the ranks), 2 epochs, the rate taken in the last. A callback after each step counts this rank's bytes: a sharded
parameter's, gradient's and state tensor's local shard (`DTensor.to_local()`), a plain tensor whole. Under the budget
the callback raises torch.OutOfMemoryError, as a GPU would, when the largest rank's count exceeds it (every rank
raises, so none waits for the others).
"""
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv2" / "bin" / "python"
LOCK = "/tmp/ddipp-run.lock"  # the shared CPU lock, taken around each launched run
IN, CLASSES, HIDDEN = 512, 10, 3
WIDTH = 4096  # 52.5M parameters
BS, STEPS, EPOCHS, LR, N_VALID = 32, 4, 2, 1e-3, 64
ROUNDS, RANKS = 3, (1, 2, 3)
STRATEGIES = {"DDP": False, "shard=True": True}  # name: to_ddp's shard
BUDGET = 512 * 2 ** 20  # bytes of parameters + gradients + optimizer state a rank may hold during the step
GRID = 64  # the widths tried under the budget are multiples of this
SECTION = "## Memory (benchmarks/memory.py)"  # README.md's section this script writes; throughput.py keeps it
BEFORE = "## On a GPU host"  # where the section goes the first time


def mlp(width: int):
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = [nn.Linear(IN, width), nn.ReLU()]
    for _ in range(HIDDEN):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def shapes(width: int) -> list:
    """The shapes of mlp(width)'s parameters."""
    dims = [IN] + [width] * (HIDDEN + 1) + [CLASSES]
    return [shape for d_in, d_out in zip(dims, dims[1:]) for shape in ((d_out, d_in), (d_out,))]


def local_elements(width: int, procs: int, sharded: bool) -> int:
    """The parameter elements the largest rank holds: FSDP2 gives rank 0 the first ceil(rows/N) rows of each."""
    return sum((math.ceil(shape[0] / procs) if sharded else shape[0]) * math.prod(shape[1:])
               for shape in shapes(width))


def learner(width: int, procs: int, meter):
    import torch
    from torch import nn
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import Adam
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(IN, CLASSES, generator=g)
    x = torch.randn(BS * STEPS * procs + N_VALID, IN, generator=g)
    y = (x @ teacher).argmax(1)
    train, valid = TensorDataset(x[N_VALID:], y[N_VALID:]), TensorDataset(x[:N_VALID], y[:N_VALID])
    dls = DataLoaders(DataLoader(train, bs=BS, drop_last=True), DataLoader(valid, bs=N_VALID), device="cpu")
    return Learner(dls, mlp(width), loss_func=nn.CrossEntropyLoss(), opt_func=Adam, cbs=meter)


def held(learn) -> dict:
    """The bytes this rank holds for the model's parameters, their gradients and the optimizer's state tensors (a
    DTensor's local shard, a plain tensor whole)."""
    import torch
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    params = list(learn.model.parameters())
    state = learn.opt.state if learn.opt is not None else {}
    return dict(params=sum(nbytes(p) for p in params), grads=sum(nbytes(p.grad) for p in params if p.grad is not None),
                opt=sum(nbytes(v) for p in params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)),
                elements=sum(nbytes(p) // p.element_size() for p in params))


def status_mb(field: str) -> float:
    """/proc/self/status's `field` (VmRSS, VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def meter_callback(budget: int):
    """A fastai callback (after ddipp's, which wraps the model) that counts held() after each step, refuses a step
    whose largest rank holds more than `budget` (0: none), times the last epoch's steps and reads the peak RSS of the
    fit (VmHWM, reset when the fit begins, read when its last epoch ends: before the fit's end gathers the model)."""
    import torch
    import torch.distributed as dist
    from fastai.callback.core import Callback

    class Meter(Callback):
        order = 0

        def before_fit(self):
            self.peak_before_mb = status_mb("VmHWM")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (ru_maxrss follows it)
            self.during, self.items, self.seconds = None, 0, 0.0

        def before_train(self):
            self.items, self.started = 0, time.perf_counter()

        def after_step(self):
            self.during = held(self.learn)
            total = torch.tensor([sum(self.during[k] for k in ("params", "grads", "opt"))], dtype=torch.float64)
            if not budget:
                return
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
            if total.item() > budget:
                raise torch.OutOfMemoryError(f"the largest rank holds {total.item():.0f} bytes of parameters, "
                                             f"gradients and optimizer state, over the budget of {budget}")

        def after_batch(self):
            if self.training:
                self.items += self.xb[0].shape[0]
                self.seconds = time.perf_counter() - self.started

        def after_epoch(self):
            self.fit_peak_rss_mb = status_mb("VmHWM")
    return Meter()


def rank_run(strategy: str, procs: int, width: int, budget: int, epochs: int, out: Path) -> None:
    """One rank of a launched run: writes what it measured to out/rank<rank>.json."""
    import torch
    import ddipp  # noqa: F401 (Learner.to_ddp)
    torch.set_num_threads(1)
    meter = meter_callback(budget)
    learn = learner(width, procs, meter).to_ddp(shard=STRATEGIES[strategy])
    rank = int(os.environ["RANK"])
    result = dict(rank=rank, strategy=strategy, procs=procs, width=width, budget=budget, refused=None)
    try:
        learn.fit(epochs, LR)
    except torch.OutOfMemoryError as e:
        result["refused"] = str(e)
    else:
        result.update(during=meter.during, items=meter.items, seconds=meter.seconds,
                      fit_peak_rss_mb=meter.fit_peak_rss_mb, between=held(learn), between_rss_mb=status_mb("VmRSS"))
    result.update(peak_rss_mb=max(meter.peak_before_mb, status_mb("VmHWM")))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_one(strategy: str, procs: int, width: int, budget: int = 0, epochs: int = EPOCHS,
            out: Path = Path("/tmp/ddipp-bench-memory")) -> dict:
    """A launched run of `procs` ranks under the CPU lock: what each rank measured, with the command's exit code."""
    out.mkdir(exist_ok=True)
    for stale in out.glob("rank*.json"):
        stale.unlink()
    locked = out / "locked"  # when the lock was taken: the run's own seconds, without waiting for others' runs
    cmd = ["flock", LOCK, "sh", "-c", 'date +%s.%N >"$0" && exec "$@"', str(locked), str(PYTHON), "-m",
           "ddipp.launch", "--nproc", str(procs), __file__,
           "--rank-of", strategy, str(procs), str(width), str(budget), str(epochs), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    took = time.time() - float(locked.read_text())
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if len(ranks) < procs:
        sys.exit(f"{strategy} at {procs} ranks, width {width}, failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(exit_code=proc.returncode, ranks=ranks, took=took)


def summary(run: dict) -> dict:
    """The largest rank's bytes during and between fits, its peak RSS, and the samples/s of all ranks."""
    ranks = run["ranks"]
    if ranks[0]["refused"]:
        return dict(refused=ranks[0]["refused"], exit_code=run["exit_code"], took_s=run["took"])
    largest = max(ranks, key=lambda r: total(r["during"]))
    return dict(refused=None, exit_code=run["exit_code"], took_s=run["took"], during=largest["during"],
                between=max((r["between"] for r in ranks), key=total),
                fit_peak_rss_mb=max(r["fit_peak_rss_mb"] for r in ranks),
                peak_rss_mb=max(r["peak_rss_mb"] for r in ranks),
                between_rss_mb=max(r["between_rss_mb"] for r in ranks),
                samples_per_s=sum(r["items"] for r in ranks) / max(r["seconds"] for r in ranks))


def total(held_bytes: dict) -> int:
    return held_bytes["params"] + held_bytes["grads"] + held_bytes["opt"]


def measure() -> dict:
    """ROUNDS interleaved rounds of each strategy at each rank count: {"strategy|ranks": [summary per round]}."""
    runs = {}
    for _ in range(ROUNDS):
        for strategy in STRATEGIES:
            for procs in RANKS:
                key = f"{strategy}|{procs}"
                runs.setdefault(key, []).append(summary(run_one(strategy, procs, WIDTH)))
                print(key, runs[key][-1], flush=True)
    return runs


def largest_width(bytes_per_element: float, procs: int, sharded: bool) -> int:
    """The largest multiple of GRID whose largest rank's bytes, at `bytes_per_element`, fit BUDGET."""
    width = GRID
    while local_elements(width + GRID, procs, sharded) * bytes_per_element <= BUDGET:
        width += GRID
    return width


def under_budget(runs: dict) -> list:
    """For DDP and shard=True at 2 and 3 ranks: the width predicted largest under BUDGET (from the bytes a parameter
    element costs, measured above) run (it must train), the next width (it must be refused), and DDP at shard's
    largest width at 2 ranks (it must be refused)."""
    per_element = {name: total(runs[f"{name}|1"][0]["during"]) / runs[f"{name}|1"][0]["during"]["elements"]
                   for name in STRATEGIES}
    tried = []
    for procs in (2, 3):
        widths = {name: largest_width(per_element[name], procs, sharded) for name, sharded in STRATEGIES.items()}
        plan = [(name, widths[name] + step, step == 0) for name in STRATEGIES for step in (0, GRID)]
        if procs == 2:
            plan.append(("DDP", widths["shard=True"], False))
        for name, width, expected in plan:
            got = summary(run_one(name, procs, width, BUDGET, epochs=1))
            tried.append(dict(strategy=name, procs=procs, width=width, expected_to_train=expected,
                              parameters=sum(math.prod(s) for s in shapes(width)),
                              predicted_bytes=round(local_elements(width, procs, STRATEGIES[name]) * per_element[name]),
                              trained=got["refused"] is None, got=got))
            print(tried[-1], flush=True)
    return tried


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def rates(runs: list) -> tuple:
    got = sorted(r["samples_per_s"] for r in runs)
    return statistics.median(got), got[0], got[-1]


def table(runs: dict) -> str:
    one = total(runs["DDP|1"][0]["during"])
    rows = ["| fastai | mode | ranks | strategy | params MB/rank | grads MB/rank | opt state MB/rank | total MB/rank | "
            "ratio to one process (bound) | peak RSS in the fit MB | peak RSS of the process MB | held between fits "
            "MB/rank (RSS MB) | samples/s (range) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for strategy, sharded in STRATEGIES.items():
        for procs in RANKS:
            got = runs[f"{strategy}|{procs}"]
            during, between = got[0]["during"], got[0]["between"]
            bound = f" (≤ {1 / procs + 0.05:.3f})" if sharded and procs > 1 else ""
            rate, low, high = rates(got)
            rows.append(f"| v2 | launched | {procs} | {strategy} | {mb(during['params'])} | {mb(during['grads'])} | "
                        f"{mb(during['opt'])} | {mb(total(during))} | {total(during) / one:.3f}{bound} | "
                        f"{statistics.median(r['fit_peak_rss_mb'] for r in got):.0f} | "
                        f"{statistics.median(r['peak_rss_mb'] for r in got):.0f} | {mb(total(between))} "
                        f"({statistics.median(r['between_rss_mb'] for r in got):.0f}) | "
                        f"{rate:.0f} ({low:.0f}–{high:.0f}) |")
    return "\n".join(rows)


def budget_table(tried: list) -> str:
    rows = ["| ranks | strategy | width | parameters | predicted MB on the largest rank | counted MB | result |",
            "|---|---|---|---|---|---|---|"]
    for t in tried:
        got = t["got"]
        counted = mb(total(got["during"])) if t["trained"] else "—"
        result = "trains" if t["trained"] else "refused (torch.OutOfMemoryError)"
        if t["trained"] != t["expected_to_train"]:
            result += ", **not as predicted**"
        rows.append(f"| {t['procs']} | {t['strategy']} | {t['width']} | {t['parameters'] / 1e6:.1f}M | "
                    f"{mb(t['predicted_bytes'])} | {counted} | {result} |")
    return "\n".join(rows)


def bounds(runs: dict) -> list:
    """Each shard=True row at N > 1 ranks: its ratio to one process against 1/N + 5 %."""
    one = total(runs["DDP|1"][0]["during"])
    said = []
    for procs in RANKS[1:]:
        ratio = total(runs[f"shard=True|{procs}"][0]["during"]) / one
        said.append(dict(procs=procs, ratio=ratio, bound=1 / procs + 0.05, within=ratio <= 1 / procs + 0.05))
    return said


def largest(tried: list) -> str:
    lines = []
    for procs in (2, 3):
        for name in STRATEGIES:
            fits = [t["width"] for t in tried if t["procs"] == procs and t["strategy"] == name and t["trained"]]
            lines.append(f"- {name} at {procs} ranks: width {max(fits) if fits else 'none'}")
    return "\n".join(lines)


def section(runs: dict, tried: list) -> str:
    parameters = sum(math.prod(s) for s in shapes(WIDTH))
    checks = "\n".join(f"- {b['procs']} ranks: {b['ratio']:.4f} ≤ {b['bound']:.4f}: {'yes' if b['within'] else 'NO'}"
                        for b in bounds(runs))
    return f"""{SECTION}

{__doc__.split(chr(10) + chr(10))[0].strip()}

    {__doc__.split(chr(10) + chr(10))[1].strip()}

{__doc__.split(chr(10) + chr(10))[2].strip()}

Width {WIDTH}: {parameters / 1e6:.1f}M parameters. Machine: {len(os.sched_getaffinity(0))} CPU cores, no GPU.
{ROUNDS} interleaved rounds; the runs held the CPU lock {seconds(runs, tried) / 60:.1f} minutes in all. The bytes (MB =
10^6 bytes) are the largest rank's, counted after the fit's last step, the same in every round; the RSS columns and
samples/s are medians. Ratio: the rank's parameters + gradients + optimizer state over one process's; shard=True at N
ranks must hold at most 1/N + 5 % of it:

{checks}

Peak RSS in the fit: VmHWM from the fit's start (the model wrapped) to its last epoch's end. Peak RSS of the process:
VmHWM over its whole life (the larger of before the fit and after it), which includes building the whole model and the
fit's end. Held between fits: what the learner holds after `fit` returned (parameters, gradients and optimizer state,
counted the same way), with the rank's RSS then.

{table(runs)}
{crashes(runs, tried)}
What these say:

- During the fit a shard=True rank holds 1/N of the parameters, gradients and optimizer state (the ratio column);
  a DDP rank holds all of them at every N.
- Between fits every rank holds everything again, under both strategies: the fit's end gathers the learner whole on
  every rank (parameters, gradients and optimizer state), so the next fit, `learn.save` or `predict` see the plain
  model. A model whose whole state does not fit one device trains under shard=True but does not come back to it.
- On CPU the resident memory does not drop by 1/N: the learner's own model is built whole on every rank, and while
  the sharded copy trains its parameters stay where they are (ddipp.core.shard sets them aside off the device only
  when the device is a GPU), so the host holds them beside the shards. The peak RSS of the process, and the RSS
  between fits, are higher under shard=True than under DDP: the fit's end allocates the whole parameters, gradients
  and optimizer state while the shards still exist, and the allocator keeps the memory they free (the tensors the
  learner holds then are DDP's, counted above). What shrinks by 1/N is what the fit keeps on its device, which on a
  GPU is the device's memory; torch.cuda.max_memory_allocated per rank is `make gpu-check`'s to measure (issue 43,
  point 6).
- Samples/s: each rank takes {STEPS} steps of {BS} an epoch, so the work grows with the ranks; 3 ranks share 2 cores.
  shard=True gathers each layer's parameters for its forward and backward and reduce-scatters its gradients, where
  DDP all-reduces the gradients once.

### Under a budget of {BUDGET / 2 ** 20:.0f} MiB a rank ({mb(BUDGET)} MB of parameters + gradients + optimizer state)

Each width is one launched fit of 1 epoch ({STEPS} steps a rank). The largest rank's bytes are predicted from what a
parameter element cost above (one process) and the rows FSDP2 gives rank 0 (ceil(rows/N) of each parameter), and each
prediction is checked by running it: the largest width predicted to fit is run and trains, the next multiple of
{GRID} is run and refused, and DDP is run at 2 ranks at shard=True's largest width there. Largest width that trains:

{largest(tried)}

{budget_table(tried)}
"""


def crashes(runs: dict, tried: list) -> str:
    """A line on the runs whose ranks wrote their results and then exited non-zero, if any."""
    got = [(key.replace("|", " at ") + " ranks", r) for key, rounds in runs.items() for r in rounds]
    got += [(f"{t['strategy']} at {t['procs']} ranks, width {t['width']}", t["got"]) for t in tried]
    crashed = [name for name, r in got if r["exit_code"] != 0]
    said = (f"Exited non-zero after every rank wrote its results (counted all the same): {', '.join(crashed)} (a "
            "rank's stderr said `terminate called without an active exception`: an abort in its teardown).")
    return f"\n{textwrap.fill(said, 120)}\n" if crashed else ""


def seconds(runs: dict, tried: list) -> float:
    """The seconds every run held the CPU lock, together."""
    return sum(r["took_s"] for got in runs.values() for r in got) + sum(t["got"]["took_s"] for t in tried)


def write_readme(text: str, section: str = SECTION, before: str = BEFORE) -> None:
    """Put `text` in benchmarks/README.md in place of its `section` (up to the next `## ` heading), or before `before`
    the first time; the rest of the file (throughput.py's sections, the GPU notes) is kept as it is."""
    readme = ROOT / "benchmarks" / "README.md"
    said = readme.read_text()
    if section in said:
        start = said.index(section)
        end = said.find("\n## ", start + len(section))
        said = said[:start] + text.rstrip("\n") + "\n" + ("\n" + said[end + 1:] if end >= 0 else "")
    elif before in said:
        start = said.index(before)
        said = said[:start] + text + "\n" + said[start:]
    else:
        said = said.rstrip("\n") + "\n\n" + text
    readme.write_text(said)


RESULTS = ROOT / "benchmarks" / "results" / "memory.json"


def main() -> None:
    runs = measure()
    tried = under_budget(runs)
    RESULTS.parent.mkdir(exist_ok=True)
    said = dict(width=WIDTH, budget=BUDGET, runs=runs, bounds=bounds(runs), under_budget=tried)
    RESULTS.write_text(json.dumps(said, indent=2) + "\n")
    report(runs, tried)


def report(runs: dict, tried: list) -> None:
    """The README section from the measured runs; fails when a bound or a prediction does not hold."""
    text = section(runs, tried)
    write_readme(text)
    print(text)
    wrong = [b for b in bounds(runs) if not b["within"]] + [t for t in tried if t["trained"] != t["expected_to_train"]]
    if wrong:
        sys.exit(f"not as the benchmark expects: {wrong}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-of"]:
        strategy, procs, width, budget, epochs, out = sys.argv[2:8]
        rank_run(strategy, int(procs), int(width), int(budget), int(epochs), Path(out))
    elif sys.argv[1:2] == ["--report"]:  # the README section again from benchmarks/results/memory.json
        said = json.loads(RESULTS.read_text())
        report(said["runs"], said["under_budget"])
    else:
        main()
