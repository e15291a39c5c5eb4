"""DistributedCallback, LRFinderBypassCallback, GCCallback: a real 2-rank gloo run against one process.

One launched run (tests/workers/fit_worker.py, the `ranks` fixture) plays tests/workers/scenario.py with
per-rank batch 16; the `reference` plays it here in one process with batch 32 (the global batch).
"""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastai.basic_train import Learner
from fastai.callbacks.flat_cos_anneal import FlatCosAnnealScheduler

from ddipp import GCCallback
from ddipp.fastai1.callbacks import _rescale_schedule
from compare import TOL, close, max_diff
from scenario import between_fits, decisions, digits_data, digits_learner, evaluation, failed_fit, sweep, swept_state

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["params_fit", "params_frozen", "params_unfrozen"])
def test_two_ranks_train_the_parameters_one_process_trains_with_the_global_batch(ranks, reference, stage):
    (r0, r1), _ = ranks
    assert max_diff(r0["story"][stage], r1["story"][stage]) == 0
    assert max_diff(r0["story"][stage], reference[stage]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["fit", "fit_frozen", "fit_unfrozen"])
def test_recorder_is_identical_on_every_rank_and_equals_one_process(ranks, reference, stage):
    (r0, r1), _ = ranks
    assert r0["story"][stage] == r1["story"][stage]
    assert close(r0["story"][stage], reference[stage])  # losses, val losses, accuracy, a batch-wise metric, FBeta


@pytest.mark.slow
def test_a_second_strategy_trains_through_the_adapter_unchanged_as_ddp_does(ranks, tmp_path):
    """tests/core/workers/stub_strategy.py's HandAveraged (each gradient averaged by a hook, no DDP) in place of
    ddipp.core.parallel.strategy, with no change to the adapter: its fit equals one process's on the global batch, and
    the adapter asked it to wrap each fit (fit_one_cycle, lr_find, the resumed fit), to read the whole state on every
    rank (the Checkpoint after each epoch) and to load it (the resume)."""
    (r0, r1), _ = ranks
    single = digits_learner(digits_data(tmp_path, bs=32))
    single.fit_one_cycle(1, 1e-2)
    stub = r0["second_strategy"]
    assert max_diff(stub["params"], r1["second_strategy"]["params"]) == 0
    assert max_diff(stub["params"], [p.detach() for p in single.model.parameters()]) <= TOL
    assert stub["calls"] == r1["second_strategy"]["calls"] == dict(wrap=3, full_state=2, load_full_state=1)


@pytest.mark.slow
def test_validate_and_get_preds_between_fits_cover_the_whole_set(ranks, reference):
    (r0, r1), _ = ranks
    assert r0["story"]["validate_before"] == r1["story"]["validate_before"]
    assert close(r0["story"]["validate_before"], reference["validate_before"])
    assert r0["story"]["validate"] == r1["story"]["validate"]
    assert close(r0["story"]["validate"], reference["validate"])
    for stage in ("preds_before", "preds"):
        assert r0["story"][stage].shape == reference[stage].shape == (359, 10)
        assert max_diff([r0["story"][stage], r1["story"][stage]], [reference[stage]] * 2) <= TOL


@pytest.mark.slow
def test_validation_is_exact_when_a_rank_has_nothing_to_validate(ranks, tmp_path):
    (r0, r1), _ = ranks
    learn = digits_learner(digits_data(tmp_path, bs=32, val_bs=2, n_valid=3))  # batches of 2 and 1 items
    learn.fit(1, 1e-2)
    expected = learn.recorder.val_losses + learn.recorder.metrics[0][:2]
    assert close(r0["tiny_valid"], expected) and close(r1["tiny_valid"], expected)


@pytest.mark.slow
def test_validation_is_exact_on_101_items_with_accuracy_and_fbeta_after_new_data_and_freeze(ranks, tmp_path):
    (r0, r1), _ = ranks
    single = between_fits(digits_learner(digits_data(tmp_path, bs=32)), bs=32)
    assert r0["between_fits"]["metrics"] == r1["between_fits"]["metrics"]
    assert len(r0["between_fits"]["metrics"][-1]) == 3  # accuracy, FBeta, a lambda; 101 items, 2 batches of 64
    for key in ("losses", "val_losses", "metrics", "lrs"):
        assert close(r0["between_fits"][key], single[key])
    assert max_diff(r0["between_fits"]["params"], single["params"]) <= TOL


@pytest.mark.slow
def test_plain_model_and_original_loaders_are_back_after_each_fit(ranks):
    (r0, r1), _ = ranks
    assert r0["story"]["restored"] and r1["story"]["restored"]


@pytest.mark.slow
def test_lr_find_sweeps_once_on_rank0_like_one_process_and_keeps_the_weights(ranks, tmp_path):
    (r0, r1), _ = ranks
    assert r0["story"]["plot"] and r1["story"]["plot"]  # recorder.plot() works on every rank
    single = sweep(digits_learner(digits_data(tmp_path, bs=16)))  # rank 0 sweeps alone, with its own batch
    for stage in ("sweep_before", "sweep_after"):
        assert r0["story"][stage] == r1["story"][stage]
        assert r0["story"][stage]["kept_weights"]
    assert len(r0["story"]["sweep_before"]["lrs"]) == 20 and len(r0["story"]["sweep_after"]["lrs"]) == 10
    assert close(r0["story"]["sweep_before"], single)


@pytest.mark.slow
def test_lr_find_distributed_mode_sweeps_with_the_global_batch(ranks, tmp_path):
    (r0, r1), _ = ranks
    single = sweep(digits_learner(digits_data(tmp_path, bs=32)))
    assert r0["distributed_sweep"] == r1["distributed_sweep"]
    assert close(r0["distributed_sweep"], single)


@pytest.mark.slow
def test_shuffled_training_uses_each_item_once_per_epoch_in_a_new_order(ranks):
    (r0, r1), _ = ranks
    n_train = 1797 - 359
    for mine, theirs in zip(r0["orders"], r1["orders"]):
        assert len(mine) == len(theirs) == n_train // 2
        assert not set(mine) & set(theirs) and len(set(mine) | set(theirs)) == n_train
    assert r0["orders"][0] != r0["orders"][1] != r0["orders"][2]


@pytest.mark.slow
def test_saved_exported_and_loaded_weights_are_identical_on_every_rank(ranks):
    (r0, r1), _ = ranks
    assert max_diff(r0["story"]["params_loaded"], r1["story"]["params_loaded"]) == 0
    assert max_diff(r0["story"]["params_loaded"], r0["story"]["params_unfrozen"]) == 0
    for rank in (r0, r1):  # export on rank 0, load_learner on both after the barrier
        assert max_diff(rank["exported"]["loaded"], r0["exported"]["trained"]) == 0


@pytest.mark.slow
def test_a_fit_that_raises_puts_back_the_plain_model_and_loaders_and_the_next_fit_works(ranks, tmp_path):
    (r0, r1), _ = ranks
    single = failed_fit(digits_learner(digits_data(tmp_path, bs=32)))
    for rank in (r0, r1):
        assert rank["failed_fit"]["raised"] == "failing on purpose" and rank["failed_fit"]["restored"]
        assert max_diff(rank["failed_fit"]["params"], single["params"]) <= TOL


@pytest.mark.slow
def test_callbacks_deciding_from_validation_decide_alike_on_every_rank_and_as_one_process(ranks, tmp_path):
    (r0, r1), _ = ranks
    single = decisions(digits_learner(digits_data(tmp_path, bs=32)))
    assert r0["decisions"]["lrs"] == r1["decisions"]["lrs"] and r0["decisions"]["losses"] == r1["decisions"]["losses"]
    assert len(single["val_losses"]) < 8  # it did stop early, and lowered the lr
    assert close({k: v for k, v in r0["decisions"].items() if k != "params"},
                  {k: v for k, v in single.items() if k != "params"})
    assert max_diff(r0["decisions"]["params"], single["params"]) <= TOL  # SaveModelCallback reloaded the best


@pytest.mark.slow
def test_only_rank0_draws_progress_and_the_results_table(ranks):
    _, out = ranks
    rank0, rank1 = ((out / f"stdout{r}.txt").read_text() for r in range(2))
    assert rank0.count("train_loss") >= 4 and "Epoch 1/2" in rank0 and "00:00<" in rank0
    assert "train_loss" not in rank1 and "00:00<" not in rank1 and "/2 :" not in rank1


def test_gc_callback_collects_at_the_end_of_each_fit(tmp_path, capsys):
    learn = digits_learner(digits_data(tmp_path, bs=32))
    learn.callback_fns.append(lambda learn: GCCallback(learn, verbose=True))
    learn.fit(1, 1e-2)
    learn.fit(1, 1e-2)
    assert capsys.readouterr().out.count("GCCallback (rank 0): collected") == 2
    assert isinstance(learn, Learner)


def _phases(sched):
    return [(p.length, *(s.n_iter for s in p.scheds.values())) for p in sched.phases]


def test_a_schedule_planned_for_the_unsharded_loader_is_the_one_fastai_plans_for_the_sharded_one(tmp_path):
    sharded = _phases(FlatCosAnnealScheduler(digits_learner(digits_data(tmp_path, bs=32)), tot_epochs=2))
    learn = digits_learner(digits_data(tmp_path, bs=16))  # 89 steps an epoch over the whole set
    sched = FlatCosAnnealScheduler(learn, tot_epochs=2)
    planned = _phases(sched)
    undo = _rescale_schedule(learn, 2 * 89, 2 * 44)  # each of 2 ranks takes 44 steps an epoch
    assert _phases(sched) == sharded == [(63, 63, 63), (25, 25, 25)]
    undo()
    assert _phases(sched) == planned == [(128, 128, 128), (50, 50, 50)]
    _rescale_schedule(learn, 3 * 89, 3 * 44)  # planned for another fit: left alone
    assert _phases(sched) == planned


@pytest.fixture(scope="module")
def failing_launches(tmp_path_factory):
    """Both stories of tests/workers/fail_fast_worker.py, launched one after the other (not to time a loaded
    machine): (exit code, stderr, seconds from rank 1's raise to the launcher's exit) each."""
    runs = {}
    for story in ("save_model", "lr_find"):
        out = tmp_path_factory.mktemp(story)
        proc = subprocess.run([sys.executable, "-m", "ddipp.launch", "--nproc", "2", "--timeout", "60",
                               str(WORKERS / "fail_fast_worker.py"), str(out), story], capture_output=True, text=True,
                              timeout=300)
        runs[story] = proc.returncode, proc.stderr, time.time() - float((out / "raised").read_text())
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("story", ["save_model", "lr_find"])
def test_a_launched_rank_that_raises_ends_the_run_with_its_error_long_before_the_timeout(failing_launches, story):
    rc, stderr, seconds = failing_launches[story]
    # a third of the 60 s timeout: 6-7 s on a quiet machine, 10 s seen under a load of 5 on 2 cores
    assert rc == 1 and seconds < 20, (seconds, stderr[-3000:])
    # rank 1 exits with its error, or is stopped while exiting when rank 0, stopped by it, ended first (rank 0 then
    # names it and its error: rank 1's log may end before its traceback)
    assert re.search(r"rank 1 (failed \(exit code 1\)|raised and was stopped|failed, with:)", stderr)
    assert "ValueError: rank 1 fails on purpose" in stderr


@pytest.mark.slow
def test_a_distributed_sweep_runs_its_num_it_steps_to_end_lr_as_one_process_with_the_global_batch(ranks, tmp_path):
    (r0, r1), _ = ranks
    single = sweep(digits_learner(digits_data(tmp_path, bs=32, n_valid=1734)), num_it=100)  # 1 batch an epoch
    assert r0["short_shard_sweep"] == r1["short_shard_sweep"]
    assert len(single["lrs"]) == len(r0["short_shard_sweep"]["lrs"]) == 100  # fastai's 68 epochs gave 68 steps
    for key in ("lrs", "losses", "kept_weights"):  # in 50 epochs of 2 passes over the shard: 50 val_losses (None)
        assert close(r0["short_shard_sweep"][key], single[key])


@pytest.mark.slow
def test_a_solo_sweep_leaves_every_rank_with_rank0s_optimizer_and_recorder(ranks, tmp_path):
    (r0, r1), _ = ranks
    single = swept_state(digits_learner(digits_data(tmp_path, bs=16)))  # rank 0 sweeps alone, with its own batch
    assert r0["solo_sweep"] == r1["solo_sweep"]
    assert r0["solo_sweep"]["opt"]["lr"] == 10  # fastai leaves the lr after the sweep's last step
    assert close(r0["solo_sweep"], single)


@pytest.mark.slow
def test_rank0_alone_validates_and_predicts_as_one_process(ranks, tmp_path):
    (r0, _), _ = ranks
    learn = digits_learner(digits_data(tmp_path, bs=32))
    learn.fit(1, 1e-2)
    single = evaluation(learn)
    alone = r0["rank0_alone"]
    assert isinstance(alone, dict), alone  # not the error of a collective with rank 1, which had left
    assert len(alone["validate"]) == 4 and close(alone["validate"], single["validate"])  # loss, accuracy, ..., FBeta
    assert close(alone["validate_plain"], single["validate_plain"])
    assert max_diff([alone["preds"], alone["losses"]], [single["preds"], single["losses"]]) <= TOL


@pytest.mark.slow
def test_csv_loggers_of_other_ranks_leave_nothing_in_the_temp_folder_whatever_ends_the_fit(ranks):
    (r0, r1), out = ranks
    for rank in (r0, r1):
        assert rank["csv_fits"] == dict(during_csv_fit=[], after_failed_fit=[], during_plain_fit=[],
                                        after_failed_begin=[])
    assert not list((out / "tmp").glob("ddipp-csv-*"))
    rows = (out / "csv" / "history.csv").read_text().splitlines()  # written by rank 0 alone
    assert rows[0].startswith("epoch,train_loss,valid_loss,accuracy") and [r[0] for r in rows[1:]] == ["0", "1"]
