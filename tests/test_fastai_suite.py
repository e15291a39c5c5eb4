"""tools/fastai_suite.py runs two of fastai's test files at once: their sessions must not spoil each other's end."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def test_two_test_sessions_ending_at_once_both_save_fastais_test_registry(tmp_path, monkeypatch):
    """fastai's conftest merges each session's API registry into one JSON file as the session ends: without turns,
    one process reads the file while the other has just emptied it to write (CI: JSONDecodeError at teardown)."""
    import ddipp  # noqa: F401  (fastai.gen_doc imports on IPython 9 with ddipp's compat, as in the suite)
    import fastai_suite_plugin
    from fastai.gen_doc import doctest
    (tmp_path / "fastai").mkdir()
    monkeypatch.setattr(doctest, "__file__", str(tmp_path / "fastai" / "gen_doc" / "doctest.py"))
    monkeypatch.setattr(doctest.TestRegistry, "registry", {f"fastai.api{i}": [{"file": "t.py", "test": "t", "line": 1}] for i in range(300)})
    monkeypatch.setattr(doctest.TestRegistry, "registry_save", doctest.TestRegistry.registry_save)
    fastai_suite_plugin.save_registry_in_turns()
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                for _ in range(100):
                    doctest.TestRegistry.registry_save()
            except Exception as e:
                (tmp_path / f"{os.getpid()}.error").write_text(repr(e))
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    assert [p.read_text() for p in tmp_path.glob("*.error")] == []
