"""fastai v2 in a notebook, done both ways and side by side: fastai's own recipe (accelerate's notebook_launcher with
`learn.distrib_ctx(in_notebook=True)`) and ddipp's notebook mode (`learn.to_ddp(nprocs=2)`), against the one-process
notebook both derive from. Executes the three notebooks of this folder in a real Jupyter kernel (nbclient +
ipykernel), writes results.json here and prints a markdown table.

    .venv2/bin/python benchmarks/fastai2_notebook/run.py        # the fastai v2 virtualenv (with accelerate)

The task is benchmarks/fastai2_own_ddp.py's: scikit-learn's digits as 1x8x8 images (1438 training items in their
order, 359 validation items), a small CNN, seed 0, global batch 64 (2 processes: 32 each), 4 epochs of
fit_one_cycle(1e-2), then the same fit again in the same kernel. Cells tagged `story` are the notebook a user writes;
cells tagged `bench` (the same in the three notebooks) record when each cell starts and ends, and add a callback
that every training process runs: it writes, per fit, when its first training batch began, the items its model
evaluated in the last validation, the recorder's values and its trained weights (to files: notebook_launcher's
processes are forks of the kernel, ddipp's are workers).

A kernel that already used CUDA (argued from the code; no GPU here): notebook_launcher forks the kernel for CUDA
(accelerate/launchers.py:213, start_method "fork" unless XPU or ROCm), and a fork of a process that initialised CUDA
fails at its first CUDA call (torch/cuda/__init__.py:578-581, "Cannot re-initialize CUDA in forked subprocess"): in
fastai's recipe that is distrib_ctx(in_notebook=True) -> setup_distrib -> torch.cuda.set_device
(fastai/distributed.py:206-208, 68). ddipp's workers are fresh interpreters (ddipp/core/group/group.py:96-99,
subprocess.Popen of sys.executable), and the learner's CUDA tensors travel to them through the CPU
(ddipp/core/group/wire.py:110-111).
"""
import difflib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results.json"
N_VALID, EPOCHS = 359, 4
NOTEBOOKS = {  # name: how it trains
    "single": "one process, batch 64 (the notebook both derive from)",
    "own_recipe": "fastai's recipe: `notebook_launcher(train, num_processes=2)`, "
                  "`distrib_ctx(in_notebook=True)` in `train`",
    "ddipp": "ddipp: `learn.to_ddp(nprocs=2)`",
}
FITS = ("fit", "refit")  # the story cells of the first fit and of the same fit again


class RecordingClient(NotebookClient):
    """nbclient that also keeps every HTML display and display update, by cell (a bar's last update replaces it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.html = {}

    def process_message(self, msg, cell, cell_index):
        self.html.setdefault(cell_index, []).append(msg["content"].get("data", {}).get("text/html", ""))
        return super().process_message(msg, cell, cell_index)


def execute(name: str, bench: Path) -> tuple:
    """Run notebook `name` top to bottom in a fresh kernel whose bench cells write to `bench`: (notebook, HTML)."""
    nb = nbformat.read(HERE / f"{name}.ipynb", as_version=4)
    os.environ["BENCH_DIR"] = str(bench)  # the kernel starts with this environment, and its processes inherit it
    os.environ["OMP_NUM_THREADS"] = "1"  # every training process 1 thread, as accelerate and ddipp give theirs here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # ddipp
    client = RecordingClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(bench)}})
    client.execute()
    return nb, client.html


def tagged(nb, tag: str) -> list:
    """The indices of the code cells of `nb` tagged `tag`."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


def code_lines(nb) -> list:
    """The story's code lines, comments and blank lines left out."""
    return code_lines_of([nb.cells[i] for i in tagged(nb, "story")])


def code_lines_of(cells: list) -> list:
    """The code lines of `cells`, comments and blank lines left out."""
    lines = [line.split("  #")[0].rstrip() for cell in cells for line in cell.source.splitlines()]
    return [line for line in lines if line.strip() and not line.strip().startswith("#")]


def lines_changed(single, other) -> dict:
    """Code lines added and removed from the single-process notebook's story to `other`'s."""
    diff = list(difflib.ndiff(code_lines(single), code_lines(other)))
    return dict(added=sum(d.startswith("+ ") for d in diff), removed=sum(d.startswith("- ") for d in diff),
                workaround=workaround_lines(other))


def workaround_lines(nb) -> int:
    """Code lines of the CPU workaround: the cells tagged `workaround`, and in the other story cells the code after
    a comment that names the "CPU workaround" (up to the next comment)."""
    count = sum(len(code_lines_of([nb.cells[i]])) for i in tagged(nb, "workaround"))
    for i in set(tagged(nb, "story")) - set(tagged(nb, "workaround")):
        marked, in_comment = False, False
        for line in map(str.strip, nb.cells[i].source.splitlines()):
            if line.startswith("#"):
                marked = "CPU workaround" in line or (in_comment and marked)
            elif line:
                count += marked
            in_comment = line.startswith("#")
    return count


def cell_times(nb, bench: Path) -> dict:
    """{cell index: (start, end)} by the kernel's clock, for every cell after the first bench cell."""
    recorded = json.loads((bench / "cells.json").read_text())
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"][1:]
    assert [nb.cells[i].source for i in code] == [source for source, _, _ in recorded["cells"]]
    return {i: (start, end) for i, (_, start, end) in zip(code, recorded["cells"])}


def rank_records(bench: Path) -> list:
    """Each rank's probe records, rank 0 first: a list per rank, one record per fit."""
    files = sorted(bench.glob("rank*.jsonl"), key=lambda f: int(f.stem[4:]))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def one_process_learner(single):
    """The single-process notebook's data and learner, built here from its cells (so: exactly its task)."""
    namespace = {}
    for tag in ("imports", "data", "learner"):
        exec(single.cells[tagged(single, tag)[0]].source, namespace)
    return namespace["learn"]


def validate(learn, weights: dict) -> list:
    """[valid loss, accuracy] of one process on `weights`."""
    learn.model.load_state_dict(weights)
    with learn.no_bar():
        return [float(v) for v in learn.validate()]


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def shown(nb, html: dict, cell: int) -> dict:
    """Whether the fit's cell showed a progress bar (during the fit) and kept the whole results table."""
    kept = "".join(o.get("data", {}).get("text/html", "") for o in nb.cells[cell].outputs)
    table = re.search(r"<th>train_loss</th>.*?<tbody>(.*?)</tbody>", kept, re.S)
    return dict(bar=any("<progress" in h for h in html.get(cell, [])),
                table_rows=table.group(1).count("<tr>") if table else 0)


def checksum(weights) -> float:
    """The sum of every weight (float64): which weights a fit started from."""
    return float(sum(w.double().sum() for w in weights))


def measure(nb, html: dict, bench: Path, reference, initial: dict) -> tuple:
    """What one executed notebook shows, per fit, against the one-process learner `reference` and the story's
    `initial` weights: (measurements, {fit: rank 0's trained weights})."""
    times, ranks = cell_times(nb, bench), rank_records(bench)
    before, fits, weights = initial, {}, {}
    for k, tag in enumerate(FITS):
        cell = tagged(nb, tag)[0]
        start, end = times[cell]
        records = [r[k] for r in ranks]
        trained = weights[tag] = torch.load(bench / f"weights.rank0.fit{k}.pt")
        kernel = torch.load(bench / f"kernel.fit{k}.pt")
        fits[tag] = dict(
            first_step_s=max(r["first_step"] for r in records) - start, total_s=end - start,
            pids=[r["pid"] for r in records], kernel_vs_trained=max_abs_diff(kernel, trained),
            kernel_vs_before_call=max_abs_diff(kernel, before),
            started_from_initial=abs(records[0]["start"] - checksum(initial.values())) < 1e-9,
            valid_items_per_rank=[r["valid_items"] for r in records], reported=records[0]["values"][-1][1:],
            one_process=validate(reference, trained), **shown(nb, html, cell))
        fits[tag]["valid_items"] = sum(fits[tag]["valid_items_per_rank"])
        before = kernel
    return dict(fits=fits, workers_ready_s=workers_ready(nb)), weights


def workers_ready(nb):
    """ddipp's "ready in N s" (its workers' start, within the first fit's cell), else None."""
    text = "".join(o.get("text", "") for o in nb.cells[tagged(nb, "fit")[0]].outputs)
    found = re.search(r"ready in ([\d.]+) s", text)
    return float(found.group(1)) if found else None


def run_all() -> dict:
    """Execute and measure the three notebooks, the single one first: {name: measurements}."""
    single = nbformat.read(HERE / "single.ipynb", as_version=4)
    reference = one_process_learner(single)
    initial = {k: v.clone() for k, v in reference.model.state_dict().items()}  # seed 0's weights, as in the story
    results, weights = {}, {}
    for name in NOTEBOOKS:
        with tempfile.TemporaryDirectory(prefix=f"fastai2_nb_{name}_") as bench:
            started = time.monotonic()
            nb, html = execute(name, Path(bench))
            results[name], weights[name] = measure(nb, html, Path(bench), reference, initial)
            results[name].update(lines=lines_changed(single, nb), notebook_s=time.monotonic() - started)
    for name, res in results.items():
        for tag, fit in res["fits"].items():
            fit["params_vs_single"] = max_abs_diff(weights[name][tag], weights["single"][tag])
    return results


def learner_back(name: str, fit: dict) -> str:
    """Whether the kernel's learner holds, after the call, the weights the fit trained (rank 0's)."""
    if fit["kernel_vs_trained"] == 0:
        return "yes (it trained here)" if name == "single" else "yes: rank 0's trained weights (max abs Δ 0)"
    if fit["kernel_vs_before_call"] == 0:
        return f"no: unchanged by the call (max abs Δ to the trained weights {fit['kernel_vs_trained']:.1e})"
    return f"no: max abs Δ to the trained weights {fit['kernel_vs_trained']:.1e}"


def versus(reported: list, reference: list) -> str:
    """'loss, accuracy (Δ loss, Δ accuracy)': as the fit reported, minus one process on the same weights."""
    (loss, acc), (ref_loss, ref_acc) = reported, reference
    return f"{loss:.4f}, {acc:.4f} ({loss - ref_loss:+.1e}, {acc - ref_acc:+.1e})"


def row(name: str, res: dict) -> str:
    """The table's row of one notebook."""
    fit, refit, lines = res["fits"]["fit"], res["fits"]["refit"], res["lines"]
    changed = "—" if name == "single" else f"+{lines['added']} −{lines['removed']}"
    if lines["workaround"]:
        changed += f" (of the added, {lines['workaround']} are the CPU workaround)"
    bars = f"{'bar' if fit['bar'] else 'no bar'}, table of {fit['table_rows']} epochs"
    return (f"| {name}.ipynb | {NOTEBOOKS[name]} | {changed} | {learner_back(name, fit)} | {bars} | "
            f"{fit['valid_items']} | {versus(fit['reported'], fit['one_process'])} | {fit['first_step_s']:.1f} s | "
            f"{fit['total_s']:.1f} s | {refit['first_step_s']:.1f} s, {refit['total_s']:.1f} s |")


def table(results: dict) -> str:
    """The markdown table of docs/benchmarks.md: one row per notebook."""
    head = ("| notebook | how | code lines changed from single.ipynb | learner back in the kernel after the fit | "
            "shown in the notebook (HTML) | validation items evaluated (set: 359) | last epoch's valid loss, "
            "accuracy (Δ vs one process on the same weights) | call → first training step | fit, call to return | "
            "warm re-fit (the same call again): → first step, total |")
    return "\n".join([head, "|" + "---|" * 10] + [row(name, res) for name, res in results.items()])


def notes(results: dict) -> str:
    """What the table's columns mean, and what else was measured."""
    own, ours = results["own_recipe"]["fits"], results["ddipp"]["fits"]
    return "\n".join([
        "- Code lines: the story cells' code (comments and blank lines left out) against single.ipynb, by difflib; "
        "a line changed counts once in each column.",
        "- Learner back: the kernel's `learn.model` after the call against the weights rank 0 trained (saved by the "
        "bench callback in the training process).",
        "- Shown: a progress bar during the fit, and the results table kept in the cell's output.",
        "- Validation items: the items the model's forward pass saw in the fit's last validation, all processes "
        f"together, by rank: own recipe {' + '.join(map(str, own['fit']['valid_items_per_rank']))}, ddipp "
        f"{' + '.join(map(str, ours['fit']['valid_items_per_rank']))}.",
        "- Times: by the kernel's clock, from the start of the cell that makes the call (the kernel's pre_run_cell "
        "event) to the first training batch of the last process to start one, and to the cell's end. ddipp's "
        f"first call starts its workers (ready in {results['ddipp']['workers_ready_s']} s), the re-fit reuses them "
        f"(same pids: {ours['fit']['pids'] == ours['refit']['pids']}); notebook_launcher forks new processes at each "
        f"call (new pids: {not set(own['fit']['pids']) & set(own['refit']['pids'])}).",
        "- The re-fit: ddipp's continues from the weights the first fit trained (it started from the initial "
        f"ones: {ours['refit']['started_from_initial']}), as one process's does; the own recipe's forks copy the "
        "kernel's learner, which the first call left untrained, so its re-fit trains from the initial weights again "
        f"(it started from them: {own['refit']['started_from_initial']}).",
        "- Parameters after the first fit, max abs Δ vs one process: own recipe "
        f"{own['fit']['params_vs_single']:.1e}, ddipp {ours['fit']['params_vs_single']:.1e}.",
    ])


def setting() -> str:
    """One line: versions, machine, load, task."""
    import accelerate
    import fastai
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"fastai {fastai.__version__}, accelerate {accelerate.__version__}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPU cores (load average {load} at the end), 2 CPU processes (gloo) for the DDP "
            f"notebooks, 1 thread per process (OMP_NUM_THREADS=1); digits ({N_VALID} validation items), a small CNN, "
            f"global batch 64, {EPOCHS} epochs of fit_one_cycle(1e-2), training order not shuffled.")


def main() -> None:
    started = time.monotonic()
    results = run_all()
    about = setting()
    print(f"{about}\n\n{table(results)}\n\n{notes(results)}\n")
    print(f"(run.py took {time.monotonic() - started:.0f} s)")
    RESULTS.write_text(json.dumps(dict(setting=about, results=results), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
