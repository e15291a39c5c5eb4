"""Notebook mode's cold start, fastai v1 and v2 in one run: how long `learn.to_ddp(nprocs=2)` blocks, and the seconds
from the call to the first training step when `learn.fit(1)` follows at once (one cell) or 20 s later (the user works
in between), `to_ddp` called right after the learner is built or 10 s after `import ddipp` (the notebook's cells in
between; the kernel's fork server has imported by then), beside fastai v2's own notebook recipe (accelerate's
`notebook_launcher` with `distrib_ctx(in_notebook=True)`, at once). Each measurement is a fresh interpreter that has
imported ipykernel, then ddipp (before torch, as README's notebooks do), torch and fastai, and built throughput.py's
learner (small CNN, digits, batch 64 a process): a kernel before the cell. Prints a table and writes
benchmarks/results/cold_start.json.

    .venv/bin/python benchmarks/cold_start.py        # from the repository root; needs both virtualenvs (+ accelerate)
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's ddipp, and throughput.py
from throughput import LR, VENV, WIDTHS, fastai_learner  # noqa: E402

ROUNDS, LATER, CELLS = 3, 20.0, 10.0
RUNS = {  # name: (fastai version, seconds from import ddipp to to_ddp past building the learner, seconds between
    #            to_ddp and fit; None: notebook_launcher)
    "ddipp, fastai v1, fit at once": (1, 0.0, 0.0),
    f"ddipp, fastai v1, fit at once, to_ddp {CELLS:.0f} s after import ddipp": (1, CELLS, 0.0),
    f"ddipp, fastai v1, fit {LATER:.0f} s later": (1, 0.0, LATER),
    "ddipp, fastai v2, fit at once": (2, 0.0, 0.0),
    f"ddipp, fastai v2, fit at once, to_ddp {CELLS:.0f} s after import ddipp": (2, CELLS, 0.0),
    f"ddipp, fastai v2, fit {LATER:.0f} s later": (2, 0.0, LATER),
    "notebook_launcher + distrib_ctx, fastai v2, at once": (2, 0.0, None),
}


def one(version: int, cells: float, later, out: Path) -> dict:
    """In this process (a kernel: ipykernel imported, then ddipp first, as README's notebooks do, then the learner
    built, and `cells` seconds from import ddipp, the notebook's cells in between): the call's times, by time.time()."""
    if later is not None:
        import ipykernel  # noqa: F401 (what a Jupyter kernel has imported: import ddipp starts its fork server)
        imported = time.time()
        import ddipp  # noqa: F401 (Learner.to_ddp)
    learn = fastai_learner(version, WIDTHS["small"], out)
    if later is None:
        return _launcher(learn)
    time.sleep(max(0.0, imported + cells - time.time()))  # the user's cells
    started = time.time()
    learn.to_ddp(nprocs=2)
    returned = time.time()
    time.sleep(later)  # the user works
    called = time.time() if later else started
    learn.fit(1, LR)
    return dict(called=called, to_ddp_s=returned - started)


def _launcher(learn) -> dict:
    """fastai v2's notebook recipe on CPU (benchmarks/fastai2_notebook/own_recipe.ipynb's workarounds)."""
    import torch
    from accelerate import notebook_launcher
    from fastai.distributed import DistributedDL

    def broadcast_on_cpu(self, t, rank):
        t = torch.LongTensor(t)
        torch.distributed.broadcast(t, rank)
        return t.tolist()
    DistributedDL._broadcast = broadcast_on_cpu

    def train():
        torch.distributed.init_process_group("gloo")
        with learn.distrib_ctx(in_notebook=True, cpu=True):
            learn.fit(1, LR)
    called = time.time()
    notebook_launcher(train, num_processes=2)
    return dict(called=called, to_ddp_s=None)


def measure(name: str, out: Path) -> dict:
    """One run of `name` in a fresh interpreter: to_ddp's blocking seconds and call -> first training step."""
    version, _, later = RUNS[name]
    for stale in out.glob("*.json"):
        stale.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([str(VENV[version]), __file__, "--one", name, str(out)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if proc.returncode or len(ranks) < 2:
        sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    call = json.loads((out / "call.json").read_text())
    return dict(to_ddp_s=call["to_ddp_s"], to_first_step_s=max(r["first_step"] for r in ranks) - call["called"])


def table(runs: dict) -> str:
    """Medians over the rounds, the range in brackets."""
    rows = ["| run | `to_ddp` blocks | call → first training step (the last rank's) |", "|---|---|---|"]
    for name, got in runs.items():
        first = sorted(r["to_first_step_s"] for r in got)
        blocks = [r["to_ddp_s"] for r in got if r["to_ddp_s"] is not None]
        shown = f"{statistics.median(blocks):.2f} s" if blocks else "—"
        rows.append(f"| {name} | {shown} | {statistics.median(first):.2f} s ({first[0]:.2f}–{first[-1]:.2f}) |")
    return "\n".join(rows)


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    runs = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory(prefix="ddipp-cold-") as out:
        for _ in range(ROUNDS):
            for name in RUNS:
                runs[name].append(measure(name, Path(out)))
                print(name, runs[name][-1], flush=True)
    about = (f"commit {commit.strip()}, {len(os.sched_getaffinity(0))} CPU cores, 2 CPU processes (gloo), "
             f"{ROUNDS} interleaved rounds, medians (range)")
    print(f"\n{about}\n\n{table(runs)}")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "cold_start.json").write_text(json.dumps(dict(setting=about, runs=runs), indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        name, out = sys.argv[2], Path(sys.argv[3])
        call = one(*RUNS[name], out)
        (out / "call.json").write_text(json.dumps(call))
    else:
        main()
