"""to_ddp(split_batches=True) on fastai v2: workers/split_story.py launched on 2 ranks with bs=15 (8 + 7 a rank,
drop_last) and in notebook mode on 3 processes with bs=16 (6 + 5 + 5, a short last batch), each against the same
story in one process at the same bs (each mode one setting: both took 2 minutes of CI more): weights, recorder,
steps per epoch, lr_find, a Checkpoint's resume, GradientAccumulation, EarlyStoppingCallback, BatchNorm with sync_bn.
The same two under to_ddp(shard=True), parameters within 1e-6 of one process's."""

import pytest

import ddipp  # noqa: F401 (adds Learner.to_ddp)
from compare import TOL, close, max_diff
from conftest import ROOT, launch_2_ranks, rank_files
from split_story import split_story
from fit_story import digits_dls, digits_learner

PHASES = ["fit", "frozen", "unfrozen", "fine_tune"]
HISTORIES = ["fit", "fit_frozen", "fit_unfrozen", "fine_tune"]


def check_story(run: dict, reference: dict, tol: float = TOL) -> None:
    """`run` against `reference`, its parameters within `tol` (1e-6 for a sharded run)."""
    assert len(run) == 1
    for key, got in run.items():
        ref = reference[key]
        for phase in PHASES:
            assert max_diff(got["params_" + phase], ref["params_" + phase]) <= tol, (key, phase)
        for name in HISTORIES:
            assert close(got[name], ref[name], tol=1e-4), (key, name)
        assert len(got["step_losses"]) == len(ref["step_losses"])  # steps per epoch
        assert close(got["validate"], ref["validate"]) and max_diff([got["preds"]], [ref["preds"]]) <= TOL
        assert got["accumulated"]["steps"] == ref["accumulated"]["steps"]
        assert max_diff(got["accumulated"]["params"], ref["accumulated"]["params"]) <= TOL, key
        assert close(got["accumulated"]["history"], ref["accumulated"]["history"], tol=1e-4)
        assert close(got["sweep"], ref["sweep"], tol=1e-4)  # the same lr_find sweep
        assert max_diff(got["resumed"], got["uninterrupted"]) <= 1e-6  # a Checkpoint resumes the split order
        assert max_diff(got["resumed"], ref["uninterrupted"]) <= TOL
        assert max_diff(got["batchnorm"]["state"], ref["batchnorm"]["state"]) <= TOL  # sync_bn: one process's
        assert close(got["batchnorm"]["history"], ref["batchnorm"]["history"], tol=1e-4)
        stopped, expected = got["early_stop"]["history"], ref["early_stop"]["history"]
        assert len(expected["values"]) == 4 and close(stopped, expected, tol=1e-4)  # stopped after the same epoch


@pytest.mark.slow
def test_launched_ranks_train_as_one_process_with_the_same_batch(split_launched, split_reference):
    for rank in split_launched:
        check_story(rank, split_reference)


@pytest.mark.slow
def test_a_notebook_learner_trains_as_one_process_with_the_same_batch(split_notebook, split_reference):
    check_story(split_notebook, split_reference)


@pytest.mark.slow
def test_sharded_launched_ranks_train_as_one_process_with_the_same_batch(tmp_path, split_reference):
    launch_2_ranks(ROOT / "tests" / "workers" / "split_worker.py", tmp_path, args=["15", "shard"])
    for rank in rank_files(tmp_path):
        check_story(rank, split_reference, tol=1e-6)


@pytest.mark.slow
def test_a_sharded_notebook_learner_on_3_processes_trains_as_one_process_with_the_same_batch(tmp_path,
                                                                                          split_reference):
    run = split_story(lambda learn, **options: learn.to_ddp(nprocs=3, split_batches=True, shard=True, **options),
                      tmp_path, [(16, False)])
    check_story(run, split_reference, tol=1e-6)


@pytest.mark.slow
def test_a_batch_smaller_than_the_processes_is_refused_before_the_first_step(tmp_path):
    learn = digits_learner(digits_dls(bs=2), tmp_path).to_ddp(nprocs=3, split_batches=True)
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(Exception, match=r"splits each batch of bs=2 over 3 processes, which leaves a process no item"):
        learn.fit(1, 1e-2)
    assert max_diff(before, [p.detach() for p in learn.model.parameters()]) == 0
