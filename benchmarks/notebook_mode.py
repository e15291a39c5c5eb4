"""Notebook mode's costs on 2 CPU processes: cold start, warm re-fit overhead over launched mode, bytes per fit and
time to the first step of a vision learner's first fit and its re-fit, and how long an exception and an interrupt take
to surface. Prints them and writes notebook_mode.json.

    .venv/bin/python benchmarks/notebook_mode.py            # from the repository root
"""
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from fastai.basic_train import LearnerCallback
from fastai.vision import ImageDataBunch, accuracy, cnn_learner, models

import ddipp
from ddipp.core.group.group import _groups

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests" / "fastai1" / "workers")]
from digits import digits_folder  # noqa: E402
from scenario import digits_data, digits_learner  # noqa: E402

torch.set_num_threads(1)
WORK = Path("/tmp/ddipp-bench")
FIT = "learn.fit(1, 1e-2)"  # the fit timed in both modes


class FirstStep(LearnerCallback):
    """Notes the wall-clock time of rank 0's first training step (it comes back with the learner)."""

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 0:
            self.at = time.time()


class RaiseOnRank1(LearnerCallback):
    def on_batch_end(self, iteration, **kwargs):
        if iteration == 2 and ddipp.rank() == 1:
            raise ValueError(time.time())


class Interrupt(LearnerCallback):
    """Rank 0 asks (through a relayed print) to be interrupted."""

    def on_batch_end(self, iteration, **kwargs):
        if iteration == 2 and ddipp.is_rank0():
            print("INTERRUPT ME", flush=True)


def _cold_start():
    learn = digits_learner(digits_data(WORK, bs=16))
    learn.callback_fns.append(FirstStep)
    started = time.time()
    learn.to_ddp(nprocs=2)
    learn.fit(1, 1e-2)
    return learn, learn.first_step.at - started


def _warm_fit(learn, repeats=5):
    learn.callback_fns.remove(FirstStep)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        learn.fit(1, 1e-2)
        times.append(time.perf_counter() - started)
    return min(times)


def _launched_fit():
    script = WORK / "launched_fit.py"
    script.write_text(f"""import sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, {str(ROOT / 'tests' / 'fastai1' / 'workers')!r})
import ddipp
from scenario import digits_data, digits_learner
learn = digits_learner(digits_data({str(WORK)!r}, bs=16)).to_ddp()
learn.fit(1, 1e-2)
times = []
for _ in range(5):
    started = time.perf_counter(); learn.fit(1, 1e-2); times.append(time.perf_counter() - started)
if ddipp.is_rank0():
    print("FIT", min(times))
""")
    out = subprocess.run([sys.executable, "-m", "ddipp.launch", "--nproc", "2", str(script)],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split("FIT")[1].split()[0])


def _vision_refits(arch):
    """An unchanged vision learner with Adam, fitted twice: per fit, the bytes sent and the seconds from the call to
    rank 0's first step."""
    path = digits_folder(WORK / "digits")
    data = ImageDataBunch.from_folder(path, size=16, bs=32, num_workers=0).normalize()
    learn = cnn_learner(data, arch, pretrained=False, metrics=accuracy).to_ddp(nprocs=2)
    learn.callback_fns.append(FirstStep)
    fits = []
    for _ in range(2):
        started = time.time()
        learn.fit(1, 1e-2)
        fits.append(dict(_groups[("cpu", "cpu")].last_sent, to_first_step_s=learn.first_step.at - started))
    learn.from_ddp()
    return fits


def _exception_delay(learn):
    learn.callback_fns.append(RaiseOnRank1)
    try:
        learn.fit(1, 1e-2)
    except ValueError as e:
        delay = time.time() - float(str(e))
    learn.callback_fns.remove(RaiseOnRank1)
    return delay


def _interrupt_delay(learn):
    learn.callback_fns.append(Interrupt)
    sent, real_write = {}, sys.stdout.write

    def write(text):  # the relayed print arrives here: interrupt this process as a kernel interrupt would
        if "INTERRUPT ME" in text and not sent:
            sent["at"] = time.perf_counter()
            threading.Thread(target=signal.raise_signal, args=(signal.SIGINT,)).start()
        return real_write(text)
    sys.stdout.write = write
    try:
        learn.fit(100, 1e-3)
    except KeyboardInterrupt:
        delay = time.perf_counter() - sent["at"]
    finally:
        sys.stdout.write = real_write
    learn.callback_fns.remove(Interrupt)
    return delay


def main():
    WORK.mkdir(exist_ok=True)
    learn, cold = _cold_start()
    warm = _warm_fit(learn)
    launched = _launched_fit()
    results = dict(cold_start_to_first_step_s=cold, warm_fit_s=warm, launched_fit_s=launched,
                   warm_refit_overhead_s=warm - launched, mlp_fit_bytes=dict(_groups[("cpu", "cpu")].last_sent),
                   exception_surfaces_s=_exception_delay(learn), interrupt_surfaces_s=_interrupt_delay(learn))
    for arch in (models.resnet18, models.resnet50):
        results[f"{arch.__name__}_first_fit"], results[f"{arch.__name__}_next_fit"] = _vision_refits(arch)
    ddipp.shutdown()
    print(json.dumps(results, indent=2))
    (Path(__file__).parent / "notebook_mode.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
