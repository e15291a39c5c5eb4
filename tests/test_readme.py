"""README.md's first screen: what ddipp is, Install and the quick start's first code block within its first 60 lines
(the tested versions and the torch floor are in docs/dependencies.md, linked from Install)."""
from conftest import ROOT

FIRST_SCREEN = 60  # lines


def test_install_and_the_first_code_block_of_the_quick_start_fit_the_first_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    install, quick_start = lines.index("## Install"), lines.index("## Quick start")
    opened = next(i for i in range(quick_start, len(lines)) if lines[i].startswith("```"))
    closed = next(i for i in range(opened + 1, len(lines)) if lines[i] == "```")
    assert install < quick_start and closed < FIRST_SCREEN, f"the quick start's first block ends at line {closed + 1}"
    assert "[docs/dependencies.md](docs/dependencies.md)" in "\n".join(lines[install:quick_start])
