"""tools/link_venv.py: .venv2 shares the files of every distribution .venv holds at the version its constraints pin."""
from importlib.metadata import distributions
from pathlib import Path

from link_venv import link, site_packages  # tools/ is on sys.path (tests/conftest.py)


def fake_dist(site: Path, name: str, version: str) -> Path:
    """A distribution as pip leaves it: a module, its dist-info and a console script outside site-packages."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (site / f"{name}.py").write_text(f"VERSION = {version!r}\n")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{name}.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n"
                                 f"../../../bin/{name},,\n")
    return site / f"{name}.py"


def test_pinned_distributions_are_linked_and_others_left_to_pip(tmp_path):
    source, target = tmp_path / "src", tmp_path / "dst"
    for venv in (source, target):
        (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    torch = fake_dist(site_packages(source), "torch", "2.14.1")
    fake_dist(site_packages(source), "fastai", "1.0.61")  # pinned at another version: pip installs the target's own
    fake_dist(site_packages(source), "pip", "25.0")  # the target has its own already
    own_pip = fake_dist(site_packages(target), "pip", "24.0")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# exact\ntorch==2.14.1\nfastai==2.8.12\npip==25.0\n")

    assert link(source, target, constraints) == 1
    linked = site_packages(target) / "torch.py"
    assert linked.stat().st_ino == torch.stat().st_ino  # one copy on disk
    assert {(d.metadata["Name"], d.version) for d in distributions(path=[str(site_packages(target))])} == {
        ("torch", "2.14.1"), ("pip", "24.0")}
    assert own_pip.read_text() == "VERSION = '24.0'\n"
    assert not (target / "bin").exists()
