"""A built wheel installs a working ddipp: every subpackage is in it, and a notebook-mode fit runs from it."""
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIT = """
import torch, ddipp, ddipp.fastai1.notebook
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from torch.utils.data import DataLoader, TensorDataset
print("FROM", ddipp.__file__, ddipp.fastai1.notebook.__file__)
torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
data = DataBunch(DataLoader(TensorDataset(x, y), 16), DataLoader(TensorDataset(x, y), 16), path=".", no_check=True,
                 device=torch.device("cpu"))
learn = Learner(data, torch.nn.Linear(4, 1), loss_func=torch.nn.MSELoss()).to_ddp(nprocs=2)
before = learn.model.weight.detach().clone()
learn.fit(1, 1e-2)
print("TRAINED", len(learn.recorder.val_losses), bool((learn.model.weight != before).any()))
"""


def test_a_wheel_installed_in_a_fresh_virtualenv_imports_and_fits(tmp_path):
    source = tmp_path / "source"  # a copy: a build/ folder left in the checkout would hide what setup.py misses
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "tmp", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("ddipp-*.whl")
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
    assert "TRAINED 1 True" in run.stdout
