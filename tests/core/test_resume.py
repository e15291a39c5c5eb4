"""ddipp.core.resume: what each fit of a restarted script does with a Checkpoint's file."""
from pathlib import Path

import pytest

from ddipp.core import resume

FILE = Path("models/checkpoint.pth")


def identity(fit, run_id="run-a", script="/x/train.py"):
    return dict(run_id=run_id, script=script, fit=fit)


def saved(fit, epoch, n_epochs=4, size=20, **kwargs):
    return dict(identity(fit, **kwargs), epoch=epoch, n_epochs=n_epochs, size=size)


@pytest.mark.parametrize("fit, expected", [(1, resume.Plan("skip")), (2, resume.Plan("resume", 3)),
                                           (3, resume.Plan("run"))])
def test_fits_before_the_files_are_skipped_its_own_resumes_later_ones_run(fit, expected):
    assert resume.plan(saved(2, 3), identity(fit), 4, 20, FILE) == expected


def test_the_files_fit_that_had_ended_is_said_to_have_ended_not_resumed(monkeypatch):
    monkeypatch.setenv(resume.RESTART_ENV, "1")
    plan = resume.plan(saved(2, 3, n_epochs=3), identity(2), 3, 20, FILE)
    assert plan == resume.Plan("finished", 3)
    assert resume.say(plan, 2, FILE) == ("ddipp: restart 1: fit 2 had ended before the restart: the state it ended "
                                         "with loaded from models/checkpoint.pth")


def test_in_a_notebooks_restarted_group_only_the_fit_sent_again_is_a_restarted_one(monkeypatch):
    monkeypatch.setattr(resume, "_sent", None)
    monkeypatch.setattr(resume, "_first_sent", None)
    monkeypatch.setenv(resume.RESTART_ENV, "1")
    assert resume.restarted()  # launched: every fit of the script that runs again
    resume.fit_sent(3)  # the fit the notebook sent again to the group that replaced the one whose worker died
    assert resume.restarted() and resume.next_fit()["fit"] == 3
    resume.fit_sent(4)
    assert not resume.restarted()  # a new fit on that group
    monkeypatch.setenv(resume.RESTART_ENV, "0")
    monkeypatch.setattr(resume, "_first_sent", None)
    resume.fit_sent(1)
    assert not resume.restarted()


@pytest.mark.parametrize("file_state", [None, saved(2, 3, run_id="run-b"), saved(2, 3, run_id=None)])
def test_a_file_of_another_launch_or_none_starts_from_scratch(file_state):
    plan = resume.plan(file_state, identity(2), 4, 20, FILE)
    assert plan == resume.Plan("fresh")
    assert resume.say(plan, 2, FILE).endswith("fit 2 starts from scratch (no checkpoint of this launch in "
                                              "models/checkpoint.pth)")


def test_another_schedule_or_script_is_refused_with_what_differs():
    with pytest.raises(ValueError, match=r"holds fit 2 of this launch, 4 epochs over a training set of size 20 at "
                                         r"learning rates None, and the restarted script's fit 2 has 5 over 20 at "
                                         r"None"):
        resume.plan(saved(2, 3), identity(2), 5, 20, FILE)
    with pytest.raises(ValueError, match=r"4 epochs over a training set of size 20 at learning rates \[0\.01\], and "
                                         r"the restarted script's fit 2 has 4 over 20 at \[0\.001\]"):
        resume.plan(dict(saved(2, 3), lrs=[1e-2]), dict(identity(2), lrs=[1e-3]), 4, 20, FILE)
    with pytest.raises(ValueError, match=r"written by /x/train\.py in this launch, and /x/other\.py reads it"):
        resume.plan(saved(2, 3), identity(2, script="/x/other.py"), 4, 20, FILE)


def test_the_lines_say_what_happened(monkeypatch):
    monkeypatch.setenv(resume.RESTART_ENV, "2")
    kept = Path("models/steps.1.pth")
    damaged = "models/steps.pth is truncated: a zip archive of 700 bytes without its end"
    assert resume.say(resume.Plan("resume", 1, 4), 4, kept, damaged) == (
        "ddipp: restart 2: fit 4 resumed after epoch 1 and 4 batches of epoch 2 from models/steps.1.pth "
        f"({damaged})")
    assert resume.say(resume.Plan("fresh"), 1, FILE, damaged) == (
        f"ddipp: restart 2: fit 1 starts from scratch ({damaged}; no earlier kept file reads back: Checkpoint(keep=N) "
        "keeps the N - 1 before the last)")
    assert resume.say(resume.Plan("run"), 4, kept, damaged) == (
        "ddipp: restart 2: fit 4 runs from its start: models/steps.1.pth, the newest file that reads back, is an "
        f"earlier fit's ({damaged})")
    monkeypatch.setenv(resume.RESTART_ENV, "1")
    assert resume.say(resume.Plan("resume", 3), 2, FILE) == ("ddipp: restart 1: fit 2 resumed after epoch 3 from "
                                                            "models/checkpoint.pth")
    assert resume.say(resume.Plan("skip"), 1, FILE) == ("ddipp: restart 1: fit 1 finished before the restart: skipped "
                                                       "(a later fit loads what it trained)")
    assert resume.say(resume.Plan("run"), 3, FILE) is None
    assert resume.say(resume.Plan("resume", 1, 10), 4, FILE) == ("ddipp: restart 1: fit 4 resumed after epoch 1 and "
                                                                "10 batches of epoch 2 from models/checkpoint.pth")


def test_a_file_written_mid_epoch_resumes_after_its_batches():
    assert resume.plan(dict(saved(2, 1), step=10), identity(2), 4, 20, FILE) == resume.Plan("resume", 1, 10)
