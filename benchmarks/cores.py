"""How the host's cores are shared by 2 launched ranks, on a compute-bound fastai v2 workload: ddipp's default (each
rank gets its share of the cores as OpenMP threads and as worker processes for a loader left at fastai's default)
against no division (every rank takes all the cores for both: what each rank did with loader workers before, and
with threads when nothing set OMP_NUM_THREADS) and against the launcher's old default (one thread, all the cores as
loader workers). 3 interleaved rounds; prints the training samples/s on rank 0 (from its 4th step, once the loader
workers run) and writes cores.json.

    .venv2/bin/python benchmarks/cores.py            # from the repository root
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/ddipp-bench-cores")
CORES = len(os.sched_getaffinity(0))
VARIANTS = {  # name: (OMP_NUM_THREADS, None for ddipp's default; whether ddipp divides a default loader's workers)
    "ddipp default (divided)": (None, True),
    "no division": (str(CORES), False),
    "old launcher default": ("1", False),
}


def train(divide: str) -> None:
    """One rank: xresnet18 (half width) on the digits as 32 px images, one epoch; rank 0 prints its samples/s."""
    import torch
    from fastai.callback.core import Callback
    from fastai.vision.all import ImageDataLoaders, Learner, accuracy, xresnet18

    import ddipp
    import ddipp.fastai2.loaders
    if divide == "no":  # every rank keeps fastai's default: a worker per core (ddipp before this change)
        ddipp.fastai2.loaders.loader_workers = lambda num_workers, fastai_default: num_workers
    sys.path.insert(0, str(ROOT / "examples"))
    from digits import digits_folder

    class StepTime(Callback):
        def after_batch(self):
            if self.training and self.iter == 2:
                self.started, self.items = time.perf_counter(), 0
                self.workers = self.learn.dl.fake_l.num_workers  # the sharded loader's, during the fit
            elif self.training and self.iter > 2:
                self.items += len(self.yb[0])

        def after_train(self):
            self.rate = self.items * ddipp.world_size() / (time.perf_counter() - self.started)

    path = digits_folder(WORK / "digits", size=32)
    dls = ImageDataLoaders.from_folder(path, valid="valid", bs=32, device="cpu")  # fastai's default num_workers
    torch.manual_seed(0)
    timer = StepTime()
    learn = Learner(dls, xresnet18(n_out=10, widen=0.5), metrics=accuracy, cbs=timer).to_ddp()
    learn.fit(1, 1e-3)
    if ddipp.is_rank0():
        print(f"RESULT {timer.rate:.1f} {torch.get_num_threads()} {timer.workers}", flush=True)


def launched(threads, divide) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    out = subprocess.run([sys.executable, "-m", "ddipp.launch", "--nproc", "2", __file__,
                          "yes" if divide else "no"],
                         capture_output=True, text=True, env=env, check=True).stdout
    rate, used_threads, used_workers = out.split("RESULT")[1].split()
    return dict(samples_per_s=float(rate), threads=int(used_threads), loader_workers=int(used_workers))


def main() -> None:
    WORK.mkdir(exist_ok=True)
    runs = {name: [] for name in VARIANTS}
    for _ in range(3):
        for name, (threads, divide) in VARIANTS.items():
            runs[name].append(launched(threads, divide))
    results = dict(machine=f"{CORES} cores", ranks=2, runs=runs)
    for name, got in runs.items():
        rates = sorted(r["samples_per_s"] for r in got)
        print(f"{name:26s} threads {got[0]['threads']}, loader workers {got[0]['loader_workers']}: "
              f"{rates[1]:.0f} samples/s (median; {rates[0]:.0f}-{rates[-1]:.0f})")
    (Path(__file__).parent / "cores.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    if "RANK" in os.environ:  # a rank the launcher started
        train(sys.argv[1])
    else:
        main()
