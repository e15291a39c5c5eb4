"""fastai v2's own DDP side by side with ddipp's fastai v2 adapter, on 2 CPU processes (gloo), against one process:
how many items each validation evaluates, its loss and accuracy, the trained parameters, and samples/s. Prints a
markdown table and writes it to benchmarks/results/fastai2_own_ddp.md.

    .venv2/bin/python benchmarks/fastai2_own_ddp.py          # from the repository root, in the fastai v2 virtualenv

fastai's DDP needs accelerate (`pip install accelerate`). The task: scikit-learn's digits as 1x8x8 images (1438
training items in their order, 359 validation items), a small CNN (no dropout, no BatchNorm), seed 0, global batch
64 (one process: 64; 2 ranks: 32 each), validation batches of 64, 4 epochs of fit_one_cycle at 1e-2. The training
order is not shuffled, so one process's batch k is the reference for the ranks' step k. Each variant first runs an
epoch whose training is skipped (the same initial weights everywhere: a pure test of the validation), then the fit.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fastai2_own_ddp.md"
GLOBAL_BS, VALID_BS, N_VALID, EPOCHS, LR = 64, 64, 359, 4, 1e-2
WORKAROUND = ("fastai's `DistributedDL._broadcast` sends the training order as a CUDA tensor (NCCL only); "
              "replaced by the same broadcast of a CPU tensor (gloo)")
LAUNCH_2 = ["-m", "ddipp.launch", "--nproc", "2"]
VARIANTS = {  # name: (how it runs, the command's launcher prefix)
    "one process": ("plain fastai, batch 64", []),
    "fastai DDP": ("`learn.distrib_ctx(sync_bn=False, cpu=True)`, 2 ranks of 32", LAUNCH_2),
    "ddipp": ("`learn.to_ddp()`, 2 ranks of 32", LAUNCH_2),
}


def digits_dls(world_size: int):
    """Digits as 1x8x8 images in fastai DataLoaders: training in order, in batches of GLOBAL_BS / world_size."""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(digits.target)
    train = DataLoader(TensorDataset(x[N_VALID:], y[N_VALID:]), bs=GLOBAL_BS // world_size, drop_last=True)
    valid = DataLoader(TensorDataset(x[:N_VALID], y[:N_VALID]), bs=VALID_BS)
    return DataLoaders(train, valid, device="cpu")


def cnn():
    from torch import nn
    torch.manual_seed(0)  # the same initial weights in every variant and on every rank
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def items_seen(model) -> dict:
    """Counts, by a forward hook, the items the model evaluates and trains on in this process (dict, updated live)."""
    seen = dict(valid=0, train=0)

    def count(module, args, output):
        seen["train" if module.training else "valid"] += args[0].shape[0]
    model.register_forward_hook(count)
    return seen


def story(learn, seen: dict) -> dict:
    """A validation-only epoch of the initial weights, then the fit: what this process saw and measured."""
    from fastai.callback.core import Callback, CancelTrainException

    class SkipTraining(Callback):
        order = 61  # after ProgressCallback made the bar that its after_train closes

        def before_train(self):
            raise CancelTrainException

    class TrainClock(Callback):
        def before_fit(self):
            self.seconds = []  # each epoch's training phase

        def before_train(self):
            self.start = time.perf_counter()

        def after_train(self):
            self.seconds.append(time.perf_counter() - self.start)

    learn.fit(1, cbs=SkipTraining())
    same_weights, valid_items = list(learn.recorder.values[-1]), seen["valid"]
    clock = TrainClock()
    learn.fit_one_cycle(EPOCHS, LR, cbs=clock)
    return dict(same_weights=same_weights, valid_items=valid_items, values=[list(v) for v in learn.recorder.values],
                params=[p.detach().clone() for p in learn.model.parameters()], trained=seen["train"],
                seconds=clock.seconds)


def run_variant(name: str, out: Path) -> None:
    """One variant's story in this process (a rank of it when launched); each rank saves what it saw."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if name == "ddipp":
        import ddipp  # noqa: F401 (before fastai: Learner.to_ddp, this rank's device)
    from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (adds Learner.fit_one_cycle)
    from fastai.learner import Learner
    from fastai.metrics import accuracy
    from torch import nn
    model = cnn()
    seen = items_seen(model)
    learn = Learner(digits_dls(world_size), model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    if name == "fastai DDP":
        import fastai.distributed
        fastai.distributed.DistributedDL._broadcast = _broadcast_on_cpu
        with learn.distrib_ctx(sync_bn=False, cpu=True):
            res = story(learn, seen)
    elif name == "ddipp":
        res = story(learn.to_ddp(), seen)
    else:
        res = story(learn, seen)
    torch.save(res, out / f"{name}.rank{rank}.pt")


def _broadcast_on_cpu(self, t, rank):
    """fastai's DistributedDL._broadcast with a CPU tensor: gloo has no CUDA tensors (fastai's calls .cuda())."""
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()


def run_all(out: Path) -> dict:
    """Every variant in its own processes; {name: [what each rank saw]}."""
    ranks = {}
    for name, (_, prefix) in VARIANTS.items():
        cmd = [sys.executable, *prefix, __file__, "--variant", name, str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ranks[name] = [torch.load(f, weights_only=False) for f in sorted(out.glob(f"{name}.rank*.pt"))]
    return ranks


def table(ranks: dict) -> str:
    """The markdown table of docs/benchmarks.md: each variant against the one process."""
    one = ranks["one process"][0]
    rows = ["| variant | how | validation items evaluated (set: 359) | same weights: valid loss, accuracy "
            "(Δ vs one process) | after the fit: valid loss, accuracy (Δ) | parameters max abs Δ | samples/s |",
            "|---|---|---|---|---|---|---|"]
    for name, (how, _) in VARIANTS.items():
        rank0 = ranks[name][0]
        evaluated = sum(r["valid_items"] for r in ranks[name])
        epoch_seconds = min(max(epoch) for epoch in zip(*(r["seconds"] for r in ranks[name])))  # the slowest rank's
        rate = sum(r["trained"] for r in ranks[name]) / EPOCHS / epoch_seconds  # in the fastest epoch
        params = max(float((a - b).abs().max()) for a, b in zip(rank0["params"], one["params"]))
        rows.append(f"| {name} | {how} | {evaluated} | {_versus(rank0['same_weights'], one['same_weights'])} | "
                    f"{_versus(rank0['values'][-1][1:], one['values'][-1][1:])} | {params:.1e} | {rate:.0f} |")
    return "\n".join(rows)


def _versus(numbers: list, reference: list) -> str:
    """'loss, accuracy (Δ loss, Δ accuracy)'."""
    (loss, acc), (ref_loss, ref_acc) = numbers[:2], reference[:2]
    return f"{loss:.4f}, {acc:.4f} ({loss - ref_loss:+.1e}, {acc - ref_acc:+.1e})"


NOTES = """- Validation items evaluated: the items the model's forward pass saw in one validation, all ranks together.
- Same weights: an epoch whose training is skipped, so every variant validates the same initial weights; after the
  fit: the last epoch's numbers. Δ: the variant's number minus one process's.
- Parameters max abs Δ: the largest difference from one process's parameters after the same 4 epochs.
- samples/s: an epoch's training items of all ranks over the slowest rank's training time (validation excluded), in
  the fastest of the epochs; the ranks share the machine's cores with each other (and with whatever else runs), so it
  is a rate on this machine, not a speed-up claim."""


def setting() -> str:
    """One line: the versions, the machine and the task."""
    import fastai
    return (f"fastai {fastai.__version__}, torch {torch.__version__}, {os.cpu_count()} CPU cores, 2 processes (gloo) "
            f"for the DDP variants; scikit-learn's digits ({N_VALID} validation items), a small CNN, global batch "
            f"{GLOBAL_BS}, {EPOCHS} epochs of fit_one_cycle({LR}), training order not shuffled.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=list(VARIANTS), help="run one variant into OUT (used by the main run)")
    parser.add_argument("out", nargs="?", type=Path)
    args = parser.parse_args()
    if args.variant:
        return run_variant(args.variant, args.out)
    with tempfile.TemporaryDirectory() as out:
        text = f"{setting()}\n\n{table(run_all(Path(out)))}\n\n{NOTES}\n- fastai DDP's workaround: {WORKAROUND}.\n"
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
