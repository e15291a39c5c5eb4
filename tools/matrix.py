"""Build the oldest and the newest stack pyproject.toml declares and run ddipp's tests on each (`make matrix`).

Each stack has a fastai v2 virtualenv (.matrix/<stack>-v2: the fastai v2 suite) and a fastai v1 one (.matrix/<stack>-v1:
a subset), reused between runs. ddipp goes in from one wheel of this checkout with its extras, pip held to the stack's
exact pins; the tests run from the checkout. Writes the table between docs/dependencies.md's matrix markers; exits 1
if a test failed. Gigabytes of downloads, so not in CI; tests/test_matrix.py keeps the stacks at pyproject.toml's
bounds."""
import contextlib
import datetime
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / ".matrix"
DIST = MATRIX / "dist"
TABLE_DOC = ROOT / "docs" / "dependencies.md"  # its "Tested versions"
BEGIN, END = "<!-- matrix -->", "<!-- /matrix -->"
PYENV = "/root/.pyenv"
LOCK = "/tmp/ddipp-cpu.lock"  # heavy jobs on this machine run one at a time (flock(1)'s lock)


@dataclass(frozen=True)
class Stack:
    """A Python and the exact versions of ddipp's dependencies, with the fastai of each flavour."""
    name: str
    python: str  # pyenv's version, as installed on this machine
    pins: Dict[str, str]  # torch, torchvision, fastprogress, cloudpickle
    fastai: Dict[str, str]  # flavour ("v1", "v2") -> fastai version

    @property
    def interpreter(self) -> str:
        """The stack's Python executable."""
        return f"{PYENV}/versions/{self.python}/bin/python{'.'.join(self.python.split('.')[:2])}"


STACKS = [
    Stack("oldest", "3.10.13",
          {"torch": "2.8.0", "torchvision": "0.23.0", "fastprogress": "1.0.3", "cloudpickle": "3.0.0"},
          {"v1": "1.0.61", "v2": "2.8.10"}),
    Stack("newest", "3.12.1",
          {"torch": "2.15.0", "torchvision": "0.29.2", "fastprogress": "1.1.6", "cloudpickle": "3.1.3"},
          {"v1": "1.0.61", "v2": "2.8.12"}),
]
EXTRA = {"v1": "fastai1", "v2": "fastai2"}
SUITES = {  # flavour -> what pytest runs there
    "v2": ["tests/fastai2"],
    "v1": ["tests/fastai1/test_compat.py", "tests/fastai1/test_learner.py",
           # a launched fit: 2 ranks against one process, after fit, fit frozen and fit unfrozen
           "tests/fastai1/test_callbacks.py::"
           "test_two_ranks_train_the_parameters_one_process_trains_with_the_global_batch",
           # a notebook fit: three fits with changes between them, against one process
           "tests/fastai1/notebook/test_fitting.py::test_changes_made_between_fits_are_honoured",
           # the core (its tests use fastai v1) and the launcher, which leans on torch's elastic agent
           "tests/core", "tests/test_launch.py"],
}
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def cpu_lock():
    """Held while a heavy job runs, so that it is timed from when it had the machine's cores."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_wheel() -> Path:
    """ddipp's wheel from a copy of this checkout's files (building in place would rewrite ddipp.egg-info here)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    shutil.rmtree(DIST, ignore_errors=True)
    with tempfile.TemporaryDirectory() as source:
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (Path(source) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, Path(source) / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(DIST), source],
                       check=True)
    return next(DIST.glob("ddipp-*.whl"))


def install(stack: Stack, flavour: str, wheel: Path) -> dict:
    """The stack's virtualenv for this flavour, made or brought up to date; what its install took (s, MiB)."""
    venv = MATRIX / f"{stack.name}-{flavour}"
    pins = {**stack.pins, "fastai": stack.fastai[flavour]}
    constraints = MATRIX / f"{stack.name}-{flavour}.constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    marker = venv / ".installed"
    wanted = json.dumps({"pins": pins, "pyproject": (ROOT / "pyproject.toml").read_text()})
    python = str(venv / "bin" / "python")
    with cpu_lock():
        started = time.monotonic()
        if not (marker.exists() and marker.read_text() == wanted):
            if not venv.exists():
                subprocess.run([stack.interpreter, "-m", "venv", str(venv)], check=True)
            # PIP_CONSTRAINT replaces this machine's torch cap (pip's config) for this command only
            requirement = f"ddipp[{EXTRA[flavour]},test] @ {wheel.as_uri()}"
            subprocess.run([python, "-m", "pip", "install", "--quiet", requirement],
                           env={**os.environ, "PIP_CONSTRAINT": str(constraints)}, check=True)
            marker.write_text(wanted)
        # this checkout's ddipp as metadata (its version), the dependencies left as they are
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)],
                       env={**os.environ, "PIP_CONSTRAINT": str(constraints)}, check=True)
        seconds = time.monotonic() - started
    size = subprocess.run(["du", "-sm", str(venv)], check=True, capture_output=True, text=True).stdout.split()[0]
    return {"install_s": round(seconds), "size_mib": int(size), "python": python}


def versions(python: str) -> dict:
    """The versions the virtualenv really has, as the table shows them."""
    names = ["torch", "torchvision", "fastprogress", "cloudpickle", "fastai"]
    code = ("import importlib.metadata as m, json, platform; "
            f"print(json.dumps({{'Python': platform.python_version(), **{{n: m.version(n) for n in {names!r}}}}}))")
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def run_suite(stack: Stack, flavour: str, python: str) -> dict:
    """pytest on the flavour's tests, from the checkout, one thread a process: counts from its junit xml."""
    report = MATRIX / "results" / f"{stack.name}-{flavour}.xml"
    report.parent.mkdir(parents=True, exist_ok=True)
    with cpu_lock():
        started = time.monotonic()
        # PYTHONPATH: the processes the tests start import this checkout's ddipp too
        subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", *SUITES[flavour]],
                       cwd=ROOT, env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)})
        seconds = time.monotonic() - started
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped,
            "test_s": round(seconds)}


def table(rows: List[dict]) -> str:
    """The markdown table of the run, with its date."""
    columns = ["stack", "Python", "torch", "torchvision", "fastprogress", "cloudpickle", "fastai", "suite",
               "passed", "failed", "skipped"]
    lines = [f"`make matrix` on {datetime.date.today().isoformat()} (CPU, 2 cores):", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_table(text: str) -> None:
    """Put the table between TABLE_DOC's matrix markers, replacing what was there."""
    doc = TABLE_DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{TABLE_DOC.relative_to(ROOT)} has no '{BEGIN}' and '{END}' lines: add them where the table "
                         f"goes (this run's table is in {MATRIX / 'table.md'})")
    head, rest = doc.split(BEGIN, 1)
    TABLE_DOC.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}")


def main() -> int:
    MATRIX.mkdir(exist_ok=True)
    wheel = build_wheel()
    rows = []
    for stack in STACKS:
        for flavour in ("v2", "v1"):
            venv = install(stack, flavour, wheel)
            row = {"stack": stack.name, **versions(venv["python"]),
                   "suite": "fastai v2 suite" if flavour == "v2" else "fastai v1 subset, core, launcher",
                   **run_suite(stack, flavour, venv["python"])}
            print(f"matrix: {stack.name}-{flavour}: {row['passed']} passed, {row['failed']} failed, "
                  f"{row['skipped']} skipped in {row['test_s']} s; install {venv['install_s']} s, "
                  f"{venv['size_mib']} MiB", flush=True)
            rows.append(row)
    text = table(rows)
    (MATRIX / "table.md").write_text(text)
    print(text)
    write_table(text)
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
