"""A built wheel installs a working ddipp (every subpackage, a notebook-mode fit), carries its license and declared
metadata, and installs into the newest stack it declares without changing any package there."""
import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from matrix import STACKS  # tools/ is on sys.path (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

FIT = """
import torch, ddipp, ddipp.fastai1.notebook
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from torch.utils.data import DataLoader, TensorDataset
print("FROM", ddipp.__file__, ddipp.fastai1.notebook.__file__)
print("VERSION", ddipp.__version__)
torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
data = DataBunch(DataLoader(TensorDataset(x, y), 16), DataLoader(TensorDataset(x, y), 16), path=".", no_check=True,
                 device=torch.device("cpu"))
learn = Learner(data, torch.nn.Linear(4, 1), loss_func=torch.nn.MSELoss()).to_ddp(nprocs=2)
before = learn.model.weight.detach().clone()
learn.fit(1, 1e-2)
print("TRAINED", len(learn.recorder.val_losses), bool((learn.model.weight != before).any()))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """ddipp's wheel, built from a copy of the checkout (a build/ folder left there would hide what the build lacks)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "tmp", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp / "dist"), str(source)], check=True, cwd=tmp)
    [built] = (tmp / "dist").glob("ddipp-*.whl")
    return built


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_virtualenv_imports_and_fits(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True)
    packages = Path(subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                            text=True).strip())
    # the project environment's dependencies, seen after the wheel (a path in a .pth file: its own .pth files,
    # among them the editable install of this checkout, are not read)
    (packages / "project-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run = subprocess.run([python, "-c", FIT], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"FROM {packages}/ddipp/__init__.py {packages}/ddipp/fastai1/notebook/__init__.py" in run.stdout
    assert f"VERSION {PROJECT['version']}" in run.stdout
    assert "TRAINED 1 True" in run.stdout


@pytest.mark.slow
def test_the_wheel_carries_the_license_and_the_declared_python_and_license(wheel):
    with zipfile.ZipFile(wheel) as whl:
        info = f"ddipp-{PROJECT['version']}.dist-info"
        metadata = whl.read(f"{info}/METADATA").decode().split("\n\n")[0].splitlines()
        license_text = whl.read(f"{info}/licenses/LICENSE").decode()
    assert license_text == (ROOT / "LICENSE").read_text()
    for line in (f"Version: {PROJECT['version']}", f"Requires-Python: {PROJECT['requires-python']}",
                 "License-Expression: Apache-2.0", "License-File: LICENSE",
                 *(f"Classifier: {c}" for c in PROJECT["classifiers"])):
        assert line in metadata


def fake_environment(path: Path, packages: dict) -> Path:
    """A virtualenv whose site-packages holds only the metadata of `packages` (name -> version): what pip sees of an
    environment with them installed, without the gigabytes."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    [site_packages] = path.glob("lib/python*/site-packages")
    for name, version in packages.items():
        info = site_packages / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
    return path / "bin" / "python"


# what else the fastai1 extra asks for, at versions a fastai v1 user has (setuptools<81: fastai v1 needs it)
FASTAI1_EXTRAS = {"setuptools": "80.10.2", "spacy": "3.8.18", "ipywidgets": "8.1.9", "nbconvert": "7.17.2"}


@pytest.mark.slow
@pytest.mark.parametrize("flavour, extra", [("v2", "fastai2"), ("v1", "fastai1")])
def test_installing_into_the_newest_stack_changes_no_package_there(wheel, tmp_path, flavour, extra):
    newest = STACKS[-1]
    installed = {**newest.pins, "fastai": newest.fastai[flavour], **(FASTAI1_EXTRAS if flavour == "v1" else {})}
    python = fake_environment(tmp_path / "env", installed)
    report = tmp_path / "report.json"
    # pip with no configuration: none of this machine's constraints (it caps torch), indexes or wheel folders
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
                          "--report", str(report), "--no-index", "--find-links", str(wheel.parent),
                          f"ddipp[{extra}]"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"pip would need other versions than {installed}:\n{run.stderr[-2000:]}"
    changes = [(item["metadata"]["name"], item["metadata"]["version"])
               for item in json.loads(report.read_text())["install"]]
    assert changes == [("ddipp", PROJECT["version"])]
