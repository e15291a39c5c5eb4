"""fastai 1.0.61's training tests under 2-rank DDP (`python tools/fastai_suite.py --ddp`, `make fastai-ddp-suite`).

Each test runs in its own `python -m ddipp.launch --nproc 2 --timeout 120 tools/fastai_ddp_rank.py TEST`, where every
Learner is `.to_ddp()`-ed as it is built; the test passes only when both ranks' junit files say it passed (the
launcher's exit status alone does not count). The ranks share a scratch folder made new for each launch. fastai's
sample data sets cannot be downloaded here, so stand-ins of the same layout are made first
(tools/fastai_ddp_data.py)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

RANKS = 2
COLLECTIVE_TIMEOUT_S = 120  # --timeout: a rank left waiting for a failed one gives up after this
LAUNCH_TIMEOUT_S = 600  # a launch still running then is killed and its test failed
RANK_SCRIPT = Path(__file__).with_name("fastai_ddp_rank.py")
DETAIL_CHARS = 120  # of a failure's first line in the table
# how a rank's collective fails when another rank has exited: a consequence, not the cause
SECONDARY = ("Connection closed by peer", "Connection reset by peer")

# The tests run, by file, each group with why: tests that build a Learner and fit it (or whose module fixture does),
# and tests of what a learner does with its files (save/load, export, purge, destroy), which to_ddp() changes.
_FAKE = "fits a fake_learner"
_GROUPS = {
    _FAKE: ["test_train.py::test_lr_find", "test_train.py::test_fit", "test_train.py::test_fit_one_cycle",
            "test_callback.py::test_callbacks_learner", "test_callback.py::test_callbacks_fit",
            "test_callbacks_misc.py::test_stop_after_n_batches", "test_callbacks_csv_logger.py::test_logger",
            "test_mod_display.py::test_progress_disabled_ctx", "test_metrics.py::test_custom_metric_class",
            "test_metrics.py::test_average_metric_naming", "test_basic_train.py::test_destroy"],
    "a learner's files and predictions: get_preds, purge, save/load (mnist_tiny), export/load_learner": [
        "test_basic_train.py::test_get_preds", "test_basic_train.py::test_purge", "test_basic_train.py::test_save_load",
        "test_basic_train.py::test_export_load_learner"],
    "tabular_learner fitted on adult_sample (the module's fixture), and one without continuous columns": [
        f"test_tabular_train.py::{t}" for t in ("test_accuracy", "test_same_categories", "test_same_fill_nan",
                                                "test_normalize", "test_empty_cont", "test_confusion_tabular")],
    "language_model_learner fitted on human_numbers (the module's fixture); a text classifier's ordered get_preds": [
        f"test_text_train.py::{t}" for t in ("test_opt_params", "test_val_loss", "test_vocabs", "test_order_preds")],
    "collab_learner fitted on movie_lens_sample": ["test_collab_train.py::test_val_loss"],
    "a simple_cnn Learner fitted on mnist_tiny (the module's fixture), then its predictions, interpretation, lr_find": [
        f"test_vision_train.py::{t}" for t in (
            "test_1cycle_lrs", "test_1cycle_moms", "test_accuracy", "test_error_rate", "test_preds", "test_interp",
            "test_interp_shortcut", "test_lrfind", "test_ClassificationInterpretation")],
}
TRAINING = {test: why for why, tests in _GROUPS.items() for test in tests}

# Tests of those files left out, with why.
NOT_RUN = {
    "test_vision_train.py::test_models_meta": "builds cnn_learners on pretrained weights (a download), fits nothing",
    "test_text_train.py::test_classifier": "builds text classifiers, fits nothing",
    "test_text_train.py::test_qrnn_works_with_no_split": "marked slow by fastai (QRNN)",
    "test_text_train.py::test_qrnn_works_if_split_fn_provided": "marked slow by fastai (QRNN)",
    "test_vision_gan.py::test_gan_trainer": "marked slow by fastai",
    "test_basic_train.py::test_memory": "CUDA only",
}


def run(tests: Path, scratch: Path, selected: list[str]) -> int:
    """Launch each test of `selected` (all of TRAINING if empty) in turn; print its row and the table; 1 if any
    failed."""
    unknown = [t for t in selected if t not in TRAINING]
    if unknown:
        sys.exit(f"fastai_suite --ddp: {unknown} are not among the training tests; choose from {sorted(TRAINING)}")
    start = time.monotonic()
    rows = []
    for test in selected or TRAINING:
        rows.append(launch(tests, scratch, test))
        print(_row(rows[-1]), flush=True)
    counts = {k: sum(r["result"] == k for r in rows) for k in ("passed", "failed", "skipped")}
    table = report(rows, counts, time.monotonic() - start)
    (scratch / "table.md").write_text(table)
    print(f"\n{table}")
    return 1 if counts["failed"] else 0


def launch(tests: Path, scratch: Path, test: str) -> dict:
    """Run `test` under `python -m ddipp.launch --nproc 2` in a fresh scratch folder; its row (test, result, detail,
    seconds)."""
    folder = scratch / re.sub(r"[^\w.-]+", "-", test)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    result = folder / "result"
    command = [sys.executable, "-m", "ddipp.launch", "--nproc", str(RANKS), "--timeout", str(COLLECTIVE_TIMEOUT_S),
               str(RANK_SCRIPT), str(tests / test), str(result)]
    start = time.monotonic()
    with open(folder / "launch.log", "w") as log:
        process = subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_code = process.wait(LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            exit_code = process.wait()
            log.write(f"\nkilled after {LAUNCH_TIMEOUT_S} s\n")
    seconds = time.monotonic() - start
    ranks = [rank_outcome(Path(f"{result}.rank{r}.xml")) for r in range(RANKS)]
    outcome, detail = merge(ranks, exit_code, (folder / "launch.log").read_text(errors="replace"))
    return dict(test=test, result=outcome, detail=detail, seconds=seconds)


def rank_outcome(xml: Path) -> tuple:
    """(outcome, first line of its message) of the one test in a rank's junit file: passed, failed, skipped, or
    missing when the rank wrote no file."""
    if not xml.exists():
        return "missing", ""
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    if not cases:
        return "missing", "no test collected"
    outcome, message = "passed", ""
    for case in cases:
        for child in case:
            kind = {"failure": "failed", "error": "failed", "skipped": "skipped"}.get(child.tag)
            if kind and outcome != "failed":
                text = child.get("message") or child.text or ""
                outcome, message = kind, (text.strip().splitlines() or [""])[0]
    return outcome, message


def merge(ranks: list, exit_code: int, log: str) -> tuple:
    """A test's (result, detail) from its ranks' outcomes: passed only when every rank passed, skipped when every
    rank skipped it, else failed with the first error line of the first rank that failed on its own (not in a
    collective whose peer had gone)."""
    outcomes = [o for o, _ in ranks]
    if outcomes == ["passed"] * len(ranks):
        return "passed", ""
    if outcomes == ["skipped"] * len(ranks):
        return "skipped", ranks[0][1]
    failed = [r for r, (outcome, _) in enumerate(ranks) if outcome == "failed"]
    if failed:
        r = min(failed, key=lambda r: any(s in ranks[r][1] for s in SECONDARY))
        return "failed", f"rank {r}: {ranks[r][1]}"
    r = outcomes.index("missing") if "missing" in outcomes else next(i for i, o in enumerate(outcomes) if o != "passed")
    last = [line for line in log.splitlines() if line.strip()][-1:] or [""]
    return "failed", f"rank {r} {outcomes[r]}; launcher exit {exit_code}: {last[0].strip()}"


def _row(row: dict) -> str:
    return f"{row['test']:<58} {row['result']:<8} {row['seconds']:5.0f} s  {_short(row['detail'])}"


def _short(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 1] + "…"


def report(rows: list, counts: dict, seconds: float) -> str:
    """The markdown table of the run: one row per test, then the counts and the time."""
    lines = ["| test | result | s |", "|---|---|---|"]
    for r in rows:
        result = {"passed": "pass (both ranks)", "skipped": f"skipped: {r['detail']}",
                  "failed": f"FAIL: {_short(r['detail'])}"}[r["result"]]
        lines.append(f"| `{r['test']}` | {result.replace('|', '/')} | {r['seconds']:.0f} |")
    totals = ", ".join(f"{n} {k}" for k, n in counts.items())
    lines.append(f"\n{len(rows)} tests under 2-rank DDP: {totals}, in {seconds:.0f} s (load average "
                 f"{os.getloadavg()[0]:.1f} at the end)")
    return "\n".join(lines) + "\n"
