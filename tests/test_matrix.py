"""`make matrix`'s stacks (tools/matrix.py) sit at the bounds of pyproject.toml's ranges, so the two cannot drift:
the oldest stack is every range's lower bound, the newest satisfies every range. No downloads: both files are read."""
import importlib.util
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
_spec = importlib.util.spec_from_file_location("matrix", ROOT / "tools" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)
OLDEST, NEWEST = (next(s for s in matrix.STACKS if s.name == name) for name in ("oldest", "newest"))
EXTRA = {"fastai1": "v1", "fastai2": "v2"}  # pyproject's extra -> the flavour whose fastai the stacks pin


def requirements():
    """Every range pyproject.toml declares on a pinned package, with the versions each stack pins for it."""
    for text in PYPROJECT["dependencies"]:
        req = Requirement(text)
        yield req, OLDEST.pins.get(req.name), NEWEST.pins.get(req.name)
    for extra, flavour in EXTRA.items():
        for req in map(Requirement, PYPROJECT["optional-dependencies"][extra]):
            if req.name == "fastai":
                yield req, OLDEST.fastai[flavour], NEWEST.fastai[flavour]


def lower_bound(req: Requirement) -> Version:
    (bound,) = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return bound


def python_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_the_stacks_pin_every_dependency_and_fastai_in_both_flavours():
    names = {Requirement(text).name for text in PYPROJECT["dependencies"]}
    assert set(OLDEST.pins) == set(NEWEST.pins) == names
    assert set(OLDEST.fastai) == set(NEWEST.fastai) == set(EXTRA.values())


def test_the_oldest_stack_is_every_ranges_lower_bound():
    for req, oldest, _ in requirements():
        assert Version(oldest) == lower_bound(req), f"{req}: the oldest stack has {oldest}"


def test_the_newest_stack_satisfies_every_range():
    for req, _, newest in requirements():
        assert req.specifier.contains(newest), f"{req}: the newest stack has {newest}"


def test_the_stacks_pythons_are_the_oldest_and_the_newest_python_declared():
    declared = sorted((c.rsplit(":: ", 1)[1] for c in PYPROJECT["classifiers"]
                       if c.startswith("Programming Language :: Python :: 3.")), key=Version)
    floor = lower_bound(Requirement(f"python{PYPROJECT['requires-python']}"))
    assert python_minor(OLDEST.python) == declared[0] == str(floor)
    assert python_minor(NEWEST.python) == declared[-1]


def test_the_table_goes_into_docs_dependencies_md_not_the_readmes_first_screen():
    assert matrix.TABLE_DOC == ROOT / "docs" / "dependencies.md"
    doc, readme = matrix.TABLE_DOC.read_text(), (ROOT / "README.md").read_text()
    assert doc.count(matrix.BEGIN) == doc.count(matrix.END) == 1 and doc.index(matrix.BEGIN) < doc.index(matrix.END)
    assert matrix.BEGIN not in readme and "(docs/dependencies.md)" in readme
