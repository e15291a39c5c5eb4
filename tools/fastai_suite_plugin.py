"""pytest plugin for fastai 1.0.61's own tests, run by tools/fastai_suite.py (`-p fastai_suite_plugin`).

Before fastai's conftest.py runs: `import ddipp` (unless FASTAI_SUITE_DDIPP=0), one torch thread, no network,
and sessions that save fastai's test registry in turns. A test that failed for want of the network is reported as
skipped, "needs a download"."""
import fcntl
import os
import socket
from pathlib import Path

import pytest

OFFLINE = "fastai's suite runs offline"
_LOCAL_HOSTS = {None, "", "localhost", "127.0.0.1", "::1"}
_getaddrinfo = socket.getaddrinfo


def prepare() -> None:
    """Offline, ddipp's fixes unless FASTAI_SUITE_DDIPP=0, one torch thread; calling it again does nothing."""
    socket.getaddrinfo = _offline_getaddrinfo
    if os.environ.get("FASTAI_SUITE_DDIPP", "1") == "1":
        import ddipp  # noqa: F401  (applies its compat fixes)
    else:
        _restore_ipython_display()
    import torch
    torch.set_num_threads(1)
    save_registry_in_turns()


def save_registry_in_turns() -> None:
    """fastai's conftest merges each session's API registry into one JSON file as the session ends (read, then
    rewrite): two test files ending at once would read it half-written, so each save holds a lock beside it."""
    from fastai.gen_doc import doctest
    save = doctest.TestRegistry.registry_save
    if getattr(save, "in_turns", False):
        return

    def registry_save_in_turns():
        lock = Path(doctest.__file__).parent.parent.resolve() / (doctest.DB_NAME + ".lock")
        with open(lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            save()
    registry_save_in_turns.in_turns = True
    doctest.TestRegistry.registry_save = staticmethod(registry_save_in_turns)


def _offline_getaddrinfo(host, *args, **kwargs):
    """socket.getaddrinfo for this machine only: any other host fails at once, naming itself."""
    if host not in _LOCAL_HOSTS:
        raise OSError(f"{OFFLINE}: no download from {host}")
    return _getaddrinfo(host, *args, **kwargs)


def _restore_ipython_display() -> None:
    """Plain fastai's conftest.py imports fastai.gen_doc, which fails on IPython 9: put back the one name it
    needs (as ddipp does), so that plain fastai's tests run at all."""
    import IPython.core.display
    from IPython.core.display_functions import display
    IPython.core.display.display = display


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    prepare()


def _needs_download(report) -> bool:
    return OFFLINE in report.longreprtext or any(OFFLINE in text for _, text in report.sections)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and _needs_download(report):
        report.outcome, report.longrepr = "skipped", (str(item.path), item.location[1], "needs a download")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test file that downloads while it is imported is skipped as a whole."""
    report = (yield).get_result()
    if report.failed and _needs_download(report):
        report.outcome, report.longrepr = "skipped", (str(collector.path), 0, "needs a download")
