"""Hard-link into a new virtualenv every distribution an installed one holds at the version a constraints file pins.

`make` runs it between creating .venv2 and installing into it: torch and its CUDA libraries, about 6 GB, are the same
files in both stacks, so .venv2 shares .venv's instead of a second copy, and pip finds them installed. Usage:
`python tools/link_venv.py SOURCE_VENV TARGET_VENV CONSTRAINTS`."""
import os
import shutil
import sys
from importlib.metadata import distributions
from pathlib import Path
from typing import Dict


def site_packages(venv: Path) -> Path:
    """The venv's one lib/pythonX.Y/site-packages folder."""
    [found] = venv.glob("lib/python*/site-packages")
    return found


def pins(constraints: Path) -> Dict[str, str]:
    """name -> version for each `name==version` line (names normalised as pip does)."""
    pinned = {}
    for line in constraints.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pinned[name.strip().lower().replace("_", "-")] = version.strip()
    return pinned


def link(source: Path, target: Path, constraints: Path) -> int:
    """Link each pinned distribution of source's site-packages that target lacks; returns how many."""
    source_site, target_site = site_packages(source), site_packages(target)
    present = {d.metadata["Name"].lower().replace("_", "-") for d in distributions(path=[str(target_site)])}
    wanted, linked = pins(constraints), 0
    for dist in distributions(path=[str(source_site)]):
        name = dist.metadata["Name"].lower().replace("_", "-")
        if wanted.get(name) != dist.version or name in present:
            continue
        for file in dist.files or ():
            if file.parts[0] == "..":  # a console script: its first line names the source venv's python
                continue
            origin, copy = source_site / file, target_site / file
            if not origin.is_file() or copy.exists():
                continue
            copy.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(origin, copy)
            except OSError:  # another file system: a copy is what pip would have made
                shutil.copy2(origin, copy)
        linked += 1
    return linked


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} SOURCE_VENV TARGET_VENV CONSTRAINTS (got {sys.argv[1:]})")
    count = link(*map(Path, sys.argv[1:]))
    print(f"{sys.argv[2]}: {count} distributions linked from {sys.argv[1]}")
