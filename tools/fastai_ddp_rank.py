"""One rank of one of fastai 1.0.61's tests under DDP, as tools/fastai_ddp_suite.py launches it:

    python -m ddipp.launch --nproc 2 --timeout 120 tools/fastai_ddp_rank.py TESTS/test_train.py::test_fit RESULT

runs that test in pytest with tools/fastai_suite_plugin.py (ddipp first, offline, one thread) and this module as a
plugin, and writes the rank's outcome to RESULT.rank<RANK>.xml (junit). Run from a scratch folder both ranks share,
so the files a test writes by relative path (models/, export.pkl, history.csv) are new for every launch.

What this plugin changes for DDP, with pytest's MonkeyPatch for this pytest session only (in these test processes;
fastai's and ddipp's files are not touched):
- every Learner is `.to_ddp()`-ed as it is built: fastai's `Learner.__post_init__`, the dataclass hook that every
  Learner and subclass runs last in its construction, calls `to_ddp()` after fastai's own. (A Learner subclass put in
  the tests' namespace would miss the learners fastai's factories build, and CollabLearner, RNNLearner and
  LanguageLearner, which subclass fastai's Learner itself);
- rank-0-only printing: fastai's test helper `utils.text.CaptureStdout` gives every rank what rank 0 printed (its
  results table), as a launched script's user sees only rank 0's output."""
import os
import sys

import pytest

_session = pytest.MonkeyPatch()


def main(argv: list[str]) -> int:
    """Run the test `argv[0]` on this rank; its junit file is `argv[1]`.rank<RANK>.xml; pytest's exit status."""
    test, result = argv
    return int(pytest.main(["-p", "fastai_suite_plugin", "-p", "no:cacheprovider", "-q", "-rfE",
                            "-o", "junit_family=xunit1", "--junitxml", f"{result}.rank{os.environ['RANK']}.xml", test],
                           plugins=[sys.modules[__name__]]))


def to_ddp_every_learner() -> None:
    """Every Learner built from now on ends its construction with `to_ddp()` (joins the launcher's group)."""
    from fastai.basic_train import Learner
    post_init = Learner.__post_init__

    def post_init_then_to_ddp(self) -> None:
        post_init(self)
        self.to_ddp()
    _session.setattr(Learner, "__post_init__", post_init_then_to_ddp)


def rank0s(text: str) -> str:
    """`text` as rank 0 has it (every rank calls this at the same point), or as is outside a process group."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def capture_rank0s_stdout() -> None:
    """fastai's test helper `CaptureStdout` made to give every rank rank 0's output."""
    import utils.text  # fastai's tests/utils/text.py, on sys.path once pytest has loaded tests/conftest.py

    class CaptureRank0Stdout(utils.text.CaptureStdout):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.out = rank0s(self.out)
    _session.setattr(utils.text, "CaptureStdout", CaptureRank0Stdout)


def pytest_sessionstart(session) -> None:
    """After fastai's conftest.py (fastai imported, tests/ on sys.path), before any test module is imported."""
    to_ddp_every_learner()
    capture_rank0s_stdout()


def pytest_sessionfinish(session) -> None:
    _session.undo()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
