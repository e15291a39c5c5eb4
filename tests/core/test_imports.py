"""ddipp.core is written once for every fastai: no module of it imports fastai, not even inside a function."""
import ast
from pathlib import Path

import ddipp.core

CORE = Path(ddipp.core.__file__).parent


def imported_modules(source: str) -> set[str]:
    """Every module an `import` or `from ... import` statement anywhere in `source` names (relative ones as written)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_imported_modules_sees_imports_inside_functions():
    assert imported_modules("def f():\n    from fastai.torch_core import defaults\n") == {"fastai.torch_core"}


def test_no_core_module_imports_fastai_or_an_adapter():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10
    found = {str(f.relative_to(CORE)): sorted(m for m in imported_modules(f.read_text())
                                              if m.split(".")[0] == "fastai" or "fastai1" in m or "fastai2" in m)
             for f in files}
    assert {f: m for f, m in found.items() if m} == {}
