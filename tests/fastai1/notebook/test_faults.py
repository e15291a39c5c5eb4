"""Faults in notebook mode with fastai v1 learners: a rank that raises, dies or hangs, an interrupted notebook;
from_ddp and stopping (the group alone, in plain torch: tests/core/group/test_group.py).

Each failure must surface here within seconds and leave the learner with what rank 0 trained up to its last completed
step (if rank 0 lives), as a local fit that fails leaves it; the workers stay if every rank lives, else none is left
behind and the next fit runs on a new group."""
import gc
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch
from fastai.basic_train import LearnerCallback
from fastai.callbacks import SaveModelCallback

import ddipp
from ddipp.core.group import binding, forkserver
from ddipp.core.group.binding import group_of
from ddipp.core.group.group import WorkerError, _groups
from ddipp.core.resume import restart_count
from compare import TOL, close, max_diff
from scenario import digits_data, digits_learner, history, params

CPU2 = ("cpu", "cpu")
WORKERS = os.path.join(os.path.dirname(__file__), "..", "workers")
pytestmark = pytest.mark.slow  # each test starts a worker group (or a process that does)


class FailOnRank1(LearnerCallback):
    def on_batch_end(self, iteration, train, **kwargs):
        if train and iteration == 3 and ddipp.rank() == 1:
            raise ValueError("rank 1 fails on purpose")


class FailAt(LearnerCallback):
    """Raises at the end of training step `STEP` of epoch 1, on rank `RANK` (a local fit is rank 0)."""
    RANK, STEP = 1, 5

    def on_batch_end(self, epoch, num_batch, train, **kwargs):
        if train and epoch == 1 and num_batch == self.STEP and ddipp.rank() == self.RANK:
            raise ValueError(f"rank {self.RANK} fails on purpose")


class FailAtLocally(FailAt):
    RANK = 0


class DieOnRank1(LearnerCallback):
    def on_batch_end(self, iteration, train, **kwargs):
        if train and iteration == 3 and ddipp.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class StallRank1(LearnerCallback):
    """Rank 1 stops taking part (stuck outside torch), so rank 0 waits in the next gradient all-reduce."""

    def on_batch_end(self, iteration, train, **kwargs):
        if train and iteration == 3 and ddipp.rank() == 1:
            threading.Event().wait()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _no_workers_left() -> bool:
    """No process under this one but its fork server (tests/conftest.py)."""
    server = forkserver.server()
    return not [p for p in psutil.Process().children(recursive=True) if not server or p.pid != server.proc.pid]


def _failing_fit(learn, callback, error, timeout=None):
    """Fit with `callback` attached: the error raised, the seconds it took, whether the weights were kept."""
    before = params(learn)
    learn.callback_fns.append(callback)
    _groups[CPU2].wait_ready()  # timed from the workers' readiness: they start in the background
    started = time.monotonic()
    with pytest.raises(error) as raised:
        learn.fit(2, 1e-2)
    took = time.monotonic() - started
    learn.callback_fns.remove(callback)
    return raised.value, took, max_diff(params(learn), before) == 0


def test_an_exception_on_one_rank_raises_here_with_its_type_rank_and_traceback(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    workers = [p.pid for p in _groups[CPU2].procs]
    error, took, kept = _failing_fit(learn, FailOnRank1, ValueError)
    assert str(error) == "rank 1 fails on purpose" and took < 10 and not kept  # 4 steps trained
    assert "raised on rank 1" in error.__notes__[0]
    assert "in on_batch_end" in str(error.__cause__) and "FailOnRank1" not in str(error)
    learn.fit(1, 1e-2)  # on the same workers
    assert len(learn.recorder.val_losses) == 1 and [p.pid for p in _groups[CPU2].procs] == workers


def _failed_then_refit(learn, capsys):
    """Fit 1 epoch, 2 with FailAt (or FailAtLocally) attached, then 1 more: what the last two left, and the messages."""
    learn.fit(1, 1e-2)
    learn.callback_fns.append(FailAtLocally if "ddp" not in vars(learn) else FailAt)
    with pytest.raises(ValueError, match="fails on purpose"):
        learn.fit(2, 1e-2)
    failed = dict(history(learn), params=params(learn), opt=_opt_state(learn), err=capsys.readouterr().err)
    learn.callback_fns.pop()
    started = time.monotonic()
    learn.fit(1, 1e-2)
    return failed, dict(history(learn), params=params(learn), took=time.monotonic() - started)


def _opt_state(learn):
    return [t.clone() for state in learn.opt.opt.state.values() for t in state.values() if hasattr(t, "clone")]


def test_a_failed_fit_keeps_what_rank0_trained_and_the_workers_fit_on(tmp_path, capsys):
    """As a local fit that fails: the weights, optimizer state and recorder of the last completed step (epoch 0 and 6
    steps of epoch 1); the same workers run the next fit, which goes on from there as one process goes on."""
    learn = digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2)
    other = digits_learner(digits_data(tmp_path / "other", bs=16)).to_ddp(nprocs=2)  # shares the group
    workers = [p.pid for p in _groups[CPU2].procs]
    failed, refit = _failed_then_refit(learn, capsys)
    other.fit(1, 1e-2)
    local_failed, local_refit = _failed_then_refit(digits_learner(digits_data(tmp_path / "one", bs=32)), capsys)
    assert len(failed["val_losses"]) == 1 and len(failed["losses"]) == 44 + 6
    assert close({k: failed[k] for k in ("losses", "val_losses", "metrics")},
                 {k: local_failed[k] for k in ("losses", "val_losses", "metrics")}, tol=1e-4)
    assert max_diff(failed["params"], local_failed["params"]) <= TOL
    assert len(failed["opt"]) == len(local_failed["opt"]) > 0 and max_diff(failed["opt"], local_failed["opt"]) <= TOL
    assert ("ddipp: the fit failed on rank 1; the learner keeps what rank 0 trained up to its last completed step "
            "(step 50 of the fit, in epoch 1)") in failed["err"]
    assert [p.pid for p in _groups[CPU2].procs] == workers and len(other.recorder.val_losses) == 1
    assert max_diff(refit["params"], local_refit["params"]) <= TOL and len(refit["val_losses"]) == 1
    print(f"next fit after a failure: {refit['took']:.1f} s")


class FailOnRank1InSweep(LearnerCallback):
    def on_batch_end(self, iteration, train, **kwargs):
        if iteration == 5 and ddipp.rank() == 1:
            raise ValueError("rank 1 fails on purpose")


@pytest.mark.parametrize("story", ["save_model_on_improvement", "distributed_lr_find"])
def test_an_exception_surfaces_as_itself_long_before_the_timeout_whatever_the_callbacks(tmp_path, story):
    """fastai's on_train_end runs after the exception: SaveModelCallback and LRFinder then load a file behind a
    barrier, which waited for the timeout while the other rank sat in the step's all-reduce."""
    learn = digits_learner(digits_data(tmp_path, bs=16))
    if story == "save_model_on_improvement":
        learn.to_ddp(nprocs=2, timeout=60)
        learn.callback_fns.append(partial(SaveModelCallback, every="improvement", name="best"))
        learn.fit(1, 1e-2)  # writes models/best.pth, which the failed fit's on_train_end then loads
        error, took, kept = _failing_fit(learn, FailOnRank1, ValueError)
    else:
        learn.to_ddp(nprocs=2, timeout=60, lr_find_mode="distributed")
        before = params(learn)
        learn.callback_fns.append(FailOnRank1InSweep)
        _groups[CPU2].wait_ready()
        started = time.monotonic()
        with pytest.raises(ValueError) as raised:
            learn.lr_find(num_it=40)
        error, took, kept = raised.value, time.monotonic() - started, max_diff(params(learn), before) == 0
    assert str(error) == "rank 1 fails on purpose" and "raised on rank 1" in error.__notes__[-1]
    assert took < 10 and kept, took  # rank 0's on_train_end loaded the weights of before (best.pth, the sweep's)
    assert len(_groups[CPU2].procs) == 2  # the workers stay


def test_a_batch_larger_than_a_ranks_share_is_refused_naming_the_sizes(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=32, n_valid=1757)).to_ddp(nprocs=2)  # 40 training items
    with pytest.raises(ValueError) as raised:
        learn.fit(1, 1e-2)
    assert str(raised.value) == ("the per-process batch size 32 is larger than a rank's share of the training set "
                                 "(40 items / 2 ranks = 20) and drop_last leaves no batch: use bs <= 20 (each rank "
                                 "takes bs items a step; the global batch is bs x 2)")


def test_a_group_no_learner_uses_stops_when_another_needs_its_devices(tmp_path):
    gc.collect()
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    dropped = _groups[CPU2]
    del learn  # without from_ddp
    single = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=1)
    assert not dropped.procs and CPU2 not in _groups and len(_groups[("cpu",)].procs) == 1
    single.from_ddp()


def test_a_rank_that_dies_raises_a_worker_error_naming_it_and_rank0s_training_stays(tmp_path, capsys):
    learn = digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2)
    error, took, kept = _failing_fit(learn, DieOnRank1, WorkerError)
    assert "rank 1" in str(error) and "killed by SIGKILL" in str(error) and took < 15
    assert _no_workers_left()
    local = digits_learner(digits_data(tmp_path / "one", bs=32))
    with pytest.raises(ValueError):
        local.fit(2, 1e-2, callbacks=[_RaiseAfterStep(local, 3)])
    assert max_diff(params(learn), params(local)) <= TOL and len(learn.recorder.losses) == 4
    assert "the fit failed on rank 1; the learner keeps what rank 0 trained" in capsys.readouterr().err
    learn.fit(1, 1e-2)  # on a new group
    assert len(learn.recorder.val_losses) == 1


class DieOnRank0(LearnerCallback):
    """Rank 0 killed at its third step of epoch 1, after its Checkpoint wrote the state after epoch 1."""

    def on_batch_end(self, epoch, num_batch, train, **kwargs):
        if train and epoch == 1 and num_batch == 2 and ddipp.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_fit_whose_rank0_dies_keeps_its_checkpoint_file_and_says_so(tmp_path, capsys):
    """Nothing comes back from a dead rank 0: the learner went back to its weights of before the fit although the
    fit's Checkpoint had written the state after epoch 1."""
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    before, checkpoint = params(learn), ddipp.Checkpoint(learn, name="kept")
    with pytest.raises(WorkerError, match="rank 0"):
        learn.fit(2, 1e-2, callbacks=[checkpoint, DieOnRank0(learn)])
    state = torch.load(checkpoint.path, weights_only=True)
    assert state["epoch"] == 1 and max_diff(params(learn), before) > 0
    assert max_diff(params(learn), [state["model"][name] for name, _ in learn.model.named_parameters()]) == 0
    assert [float(v) for v in learn.recorder.losses] == state["recorder"]["losses"]
    assert len(learn.recorder.nb_batches) == 1
    assert torch.equal(learn.opt.opt.state_dict()["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])
    said = capsys.readouterr().err
    assert (f"the learner keeps the state of the fit's Checkpoint file {checkpoint.path}, written after epoch 1 (step "
            f"{len(state['recorder']['losses'])} of the fit): rank 0 sent nothing back") in said


class DieOnRank1ThenOnRank0(LearnerCallback):
    """Rank 1 killed at step 4 of the fit; in the restarted group, rank 0 at its third step of epoch 1."""

    def on_batch_end(self, epoch, num_batch, iteration, train, **kwargs):
        first = restart_count() == 0
        if train and (iteration == 3 if first else (epoch, num_batch) == (1, 2)) and ddipp.rank() == int(first):
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_restarted_fit_whose_rank0_dies_keeps_the_newer_checkpoint_file_and_says_so(tmp_path, capsys):
    """Before the restart rank 0 trained 4 steps; the restarted group wrote the state after epoch 1, then its rank 0
    died: the file is the newer."""
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2, restarts=1)
    checkpoint = ddipp.Checkpoint(learn, name="kept")
    with pytest.raises(WorkerError, match="rank 0"):
        learn.fit(2, 1e-2, callbacks=[checkpoint, DieOnRank1ThenOnRank0(learn)])
    state = torch.load(checkpoint.path, weights_only=True)
    assert state["epoch"] == 1 and len(state["recorder"]["losses"]) > 4
    assert max_diff(params(learn), [state["model"][name] for name, _ in learn.model.named_parameters()]) == 0
    assert [float(v) for v in learn.recorder.losses] == state["recorder"]["losses"]
    said = capsys.readouterr().err
    assert "ddipp: restart 1 of 1" in said and (
        f"the learner keeps the state of the fit's Checkpoint file {checkpoint.path}, written after epoch 1 (step "
        f"{len(state['recorder']['losses'])} of the fit): newer than what rank 0 trained before the restart (step 4)"
        ) in said


class _RaiseAfterStep(LearnerCallback):
    def __init__(self, learn, iteration):
        super().__init__(learn)
        self.iteration = iteration

    def on_batch_end(self, iteration, train, **kwargs):
        if train and iteration == self.iteration:
            raise ValueError("failing on purpose")


def test_a_hung_collective_fails_after_the_timeout(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2, timeout=5)
    error, took, kept = _failing_fit(learn, StallRank1, RuntimeError)
    assert "raised on rank 0" in error.__notes__[0] and 5 <= took < 20 and not kept  # rank 0's 4 steps came back
    assert len(learn.recorder.losses) == 4 and _no_workers_left()  # rank 1 never ended its fit


def test_from_ddp_stops_the_group_once_no_learner_uses_it_and_shutdown_stops_all(tmp_path):
    gc.collect()  # learners of earlier tests
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    other = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    group = _groups[CPU2]
    assert len(group.procs) == 2
    learn.from_ddp()
    assert group.alive and "fit" not in vars(learn) and "ddp" not in vars(learn)
    learn.fit(1, 1e-2)  # locally again
    other.from_ddp()
    assert not group.procs and CPU2 not in _groups and _no_workers_left()
    other.to_ddp(nprocs=2)
    logs = _groups[CPU2].logs
    assert logs.parent == Path(tempfile.gettempdir()) and logs.is_dir()
    ddipp.shutdown()
    assert not _groups and _no_workers_left() and not logs.exists()


def _reader(proc):
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def _wait_for(lines, word, timeout=120):
    """The rest of the first line from the process's stdout that contains `word`."""
    deadline = time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if word in line:
            return line.split(word, 1)[1].split()


class InterruptTheNotebook(LearnerCallback):
    """Notes the model's class in the fit; after training step 3 rank 0 interrupts the notebook (the process that made
    this callback), as the kernel's interrupt button does."""

    def __init__(self, learn):
        super().__init__(learn)
        self.notebook = os.getpid()

    def on_train_begin(self, **kwargs):
        self.model_kind = type(self.learn.model).__name__

    def on_batch_end(self, iteration, train, **kwargs):
        if train and iteration == 3 and ddipp.rank() == 0:
            os.kill(self.notebook, signal.SIGINT)


def test_a_group_of_one_process_trains_as_plain_fastai_and_its_interrupt_keeps_what_was_trained(tmp_path):
    """As with fastai v2: below 2 ranks no DDP, no sharding, no loss all-reduce; the interrupt stops it all the same."""
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=1)
    before, interrupt = params(learn), InterruptTheNotebook(learn)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a CI job may start with SIGINT ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            learn.fit(50, 1e-3, callbacks=[interrupt])  # more than the 4 s the interrupt waits
    finally:
        signal.signal(signal.SIGINT, previous)
    steps = len(getattr(getattr(learn, "recorder", None), "losses", []))  # none: the fit was killed
    assert interrupt.model_kind == type(learn.model).__name__
    assert 4 <= steps < 88 and max_diff(params(learn), before) > 0  # 88 steps an epoch
    learn.from_ddp()


def test_an_interrupt_keeps_what_was_trained_a_stuck_group_is_killed_and_a_killed_notebook_leaves_none(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "notebook_parent.py"), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _reader(proc)
        first = [int(pid) for pid in _wait_for(lines, "WORKERS")]
        _wait_for(lines, "TRAINING")
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        trained, epochs, steps = _wait_for(lines, "INTERRUPTED", timeout=30)
        assert time.monotonic() - interrupted < 5 and trained == "True" and int(steps) >= 2  # as plain fastai
        epochs, *second = _wait_for(lines, "REFIT")
        assert epochs == "1" and list(map(int, second)) == first  # the same workers: no new start
        _wait_for(lines, "TRAINING")
        proc.send_signal(signal.SIGINT)  # rank 1 is stuck outside torch: the ranks cannot stop together
        interrupted = time.monotonic()
        assert _wait_for(lines, "STUCK", timeout=30) == ["True"]  # weights from before the fit
        assert time.monotonic() - interrupted < 8 and all(_gone(pid) for pid in first)
        _wait_for(lines, "TRAINING")
        third = [p.pid for p in psutil.Process(proc.pid).children()]
        assert len(third) == 2 and not set(third) & set(first)
        proc.kill()
        killed = time.monotonic()
        while not all(_gone(pid) for pid in third) and time.monotonic() - killed < 15:
            time.sleep(0.2)  # polling the process table, not synchronising with it
        assert all(_gone(pid) for pid in third)
    finally:
        proc.kill()
        proc.wait()


def _interrupt(*args):
    raise KeyboardInterrupt  # as the kernel's stop button does there


@pytest.mark.parametrize("moment", ["at the restart line", "as the new group starts"])
def test_an_interrupt_as_a_restart_begins_keeps_what_rank0_trained_before_it(tmp_path, capsys, monkeypatch, moment):
    """Stopped at 'ddipp: restart 1 of 1', the learner went back to its weights of before the fit."""
    learn = digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2, restarts=1)
    before = params(learn)

    def interrupted_restart(learn, after=None, attempt=0):
        if attempt and moment == "at the restart line":
            _interrupt()
        group = group_of(learn, after, attempt)
        if attempt:
            monkeypatch.setattr(group, "wait_ready", _interrupt)
        return group
    monkeypatch.setattr(binding, "group_of", interrupted_restart)
    with pytest.raises(KeyboardInterrupt):
        learn.fit(2, 1e-2, callbacks=[DieOnRank1(learn)])
    local = digits_learner(digits_data(tmp_path / "one", bs=32))
    with pytest.raises(ValueError):
        local.fit(2, 1e-2, callbacks=[_RaiseAfterStep(local, 3)])
    assert max_diff(params(learn), before) > 0 and max_diff(params(learn), params(local)) <= TOL
    said = capsys.readouterr().err
    assert len(learn.recorder.losses) == 4 and "ddipp: restart 1 of 1" in said
    assert "the learner keeps what rank 0 trained" in said
    assert "to its last completed step (step 4 of the fit, in epoch 0)" in said
