"""ddipp.core is written once for every fastai: no module of it imports fastai, an adapter (ddipp.fastai1, ...) or ddipp
itself (which imports the adapter), not even inside a function or by a string given to importlib."""
import ast
from pathlib import Path

import ddipp.core

CORE = Path(ddipp.core.__file__).parent


def imported_modules(source: str, module: str) -> set[str]:
    """Every module the code of `module` (its dotted name) may import, absolute: the modules its `import` and
    `from ... import` statements name (relative ones resolved), and the strings and f-string parts that start like
    "ddipp" or "fastai" (importlib.import_module's argument)."""
    package = module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            names.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.split(".")[0] in ("ddipp", "fastai"):
            names.add(node.value)
    return names


def forbidden(name: str) -> bool:
    """True for fastai, an adapter of ddipp's, and ddipp itself."""
    return name == "ddipp" or name.startswith("ddipp.fastai") or name.split(".")[0] == "fastai"


def test_imported_modules_sees_imports_inside_functions_relative_ones_and_strings():
    source = ("import importlib\n"
              "from .. import dist\n"
              "def f():\n"
              "    from fastai.torch_core import defaults\n"
              "    from ... import fastai1\n"
              "    import ddipp\n"
              "    return importlib.import_module(f'ddipp.fastai{major}.notebook.fitting')\n")
    found = imported_modules(source, "ddipp.core.group.worker")
    assert found == {"importlib", "ddipp.core", "fastai.torch_core", "ddipp", "ddipp.fastai"}
    assert sorted(filter(forbidden, found)) == ["ddipp", "ddipp.fastai", "fastai.torch_core"]


def test_no_core_module_imports_fastai_an_adapter_or_ddipp_itself():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10
    root = CORE.parents[1]
    found = {}
    for file in files:
        module = ".".join(file.relative_to(root).with_suffix("").parts)
        found[module] = sorted(filter(forbidden, imported_modules(file.read_text(), module)))
    assert "ddipp.core.group.worker" in found
    assert {module: names for module, names in found.items() if names} == {}
