"""docs/memory.md's CPU script (its python block that loads the digits), run as written: in one process by
tests/fastai2/test_memory_page.py, on 2 launched ranks by extras_worker.py."""
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "docs" / "memory.md"


def page_script() -> str:
    return next(block for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S) if "load_digits" in block)


def run_page() -> dict:
    """What the script found and trained: bs_find's size, the model's parameters and buffers, the recorder's rows."""
    scope = {}
    exec(page_script(), scope)
    learn = scope["learn"]
    return dict(bs=scope["bs"], state=[t.detach().clone() for t in learn.model.state_dict().values()],
                values=[[float(v) for v in row] for row in learn.recorder.values])
