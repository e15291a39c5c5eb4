"""tools/fastai_suite.py runs two of fastai's test files at once: their sessions must not spoil each other's end."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_two_test_sessions_ending_at_once_both_save_fastais_test_registry(tmp_path, monkeypatch):
    """fastai's conftest merges each session's API registry into one JSON file as the session ends: without turns,
    one process reads the file while the other has just emptied it to write (CI: JSONDecodeError at teardown)."""
    import ddipp  # noqa: F401  (fastai.gen_doc imports on IPython 9 with ddipp's compat, as in the suite)
    import fastai_suite_plugin
    from fastai.gen_doc import doctest
    (tmp_path / "fastai").mkdir()
    monkeypatch.setattr(doctest, "__file__", str(tmp_path / "fastai" / "gen_doc" / "doctest.py"))
    monkeypatch.setattr(doctest.TestRegistry, "registry",
                        {f"fastai.api{i}": [{"file": "t.py", "test": "t", "line": 1}] for i in range(300)})
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


def _junit(tmp_path, body: str, rank: int) -> "Path":
    """The junit file pytest writes for a test `test_x` whose body is `body`, run as rank `rank` (RANK set)."""
    import subprocess
    test = tmp_path / "test_x.py"
    test.write_text(f"import os, pytest\n\ndef test_x():\n    rank = int(os.environ['RANK'])\n    {body}\n")
    xml = tmp_path / f"result.rank{rank}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    "--junitxml", str(xml), str(test)], env={**os.environ, "RANK": str(rank)}, cwd=tmp_path,
                   capture_output=True)
    return xml


def _merged(tmp_path, body: str, ranks: int = 2, exit_code: int = 1, log: str = "") -> tuple:
    import fastai_ddp_suite
    xmls = [_junit(tmp_path, body, r) for r in range(ranks)]
    return fastai_ddp_suite.merge([fastai_ddp_suite.rank_outcome(x) for x in xmls], exit_code, log)


@pytest.mark.slow
def test_a_fastai_test_under_ddp_passes_only_when_every_rank_passes_it(tmp_path):
    assert _merged(tmp_path, "assert rank >= 0", exit_code=0) == ("passed", "")


@pytest.mark.slow
def test_a_fastai_test_failing_on_one_rank_only_is_reported_failed_with_that_ranks_first_error_line(tmp_path):
    """The launcher's exit status is not trusted: rank 1's junit file alone says the test failed there."""
    result, detail = _merged(tmp_path, "assert rank == 0, 'only rank 0 has the table\\nsecond line'", exit_code=0)
    assert (result, detail) == ("failed", "rank 1: AssertionError: only rank 0 has the table")


@pytest.mark.slow
def test_a_fastai_test_failing_on_one_rank_is_reported_with_that_ranks_error_not_the_lost_peer_of_another(tmp_path):
    """Rank 1 fails its assertion and exits; rank 0's next collective then fails for want of its peer."""
    body = "assert rank == 0 or False, 'the cause'\n    raise RuntimeError('pair.cc:561] Connection closed by peer')"
    assert _merged(tmp_path, body) == ("failed", "rank 1: AssertionError: the cause")


@pytest.mark.slow
def test_a_fastai_test_skipped_on_every_rank_is_reported_skipped_with_its_reason(tmp_path):
    assert _merged(tmp_path, "pytest.skip('needs a download')", exit_code=0) == ("skipped", "needs a download")


@pytest.mark.slow
def test_a_rank_that_wrote_no_result_fails_the_test_naming_it_and_the_launchers_last_line(tmp_path):
    import fastai_ddp_suite
    ranks = [fastai_ddp_suite.rank_outcome(_junit(tmp_path, "pass", 0)),
             fastai_ddp_suite.rank_outcome(tmp_path / "result.rank1.xml")]
    log = "rank 0 output\npython -m ddipp.launch: rank 1 failed (exit code -9)\n\n"
    assert fastai_ddp_suite.merge(ranks, 1, log) == (
        "failed", "rank 1 missing; launcher exit 1: python -m ddipp.launch: rank 1 failed (exit code -9)")


def test_the_ddp_suites_training_tests_are_named_as_file_and_test_and_none_is_also_left_out():
    import fastai_ddp_suite
    assert all(t.startswith("test_") and ".py::test_" in t for t in fastai_ddp_suite.TRAINING)
    assert not set(fastai_ddp_suite.TRAINING) & set(fastai_ddp_suite.NOT_RUN)
