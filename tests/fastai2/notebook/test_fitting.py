"""fastai v2 notebook mode: a learner bound with to_ddp(nprocs=2) in this plain process fits on a worker group and is
left as a local fit with the global batch leaves it (workers/fit_story.py, played here in one process as reference)."""
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from fastai.callback.core import Callback
from fastai.learner import load_learner

WORKERS = Path(__file__).parents[1] / "workers"
from compare import TOL, close, max_diff
from fit_story import (changes_between_fits, digits_dls, digits_learner, history, params, story, sweep,
                       tabular_digits_learner, wide_digits_learner)

import ddipp
from ddipp.core.group.group import WorkerError, _groups
from ddipp.fastai2.notebook import binding as notebook_binding
from ddipp.fastai2.notebook.fitting import apply_results

CPU2 = ("cpu", "cpu")
PHASES = ["fit", "frozen", "unfrozen", "fine_tune"]  # fit_one_cycle; freeze + fit; unfreeze + fit_flat_cos; fine_tune


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The story played by a notebook-mode learner (batch 16 a rank), and the workers' pids before and after."""
    learn = digits_learner(digits_dls(bs=16), tmp_path_factory.mktemp("nb")).to_ddp(nprocs=2)
    started = [p.pid for p in _groups[CPU2].procs]
    res = story(learn)
    res["pids"] = started, [p.pid for p in _groups[CPU2].procs]
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The story in one process with batch 32, the global batch."""
    return story(digits_learner(digits_dls(bs=32), tmp_path_factory.mktemp("ref")))


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_the_notebook_learner_gets_the_weights_and_recorder_one_process_trains(notebook, reference, phase):
    recorded = phase if phase in ("fit", "fine_tune") else "fit_" + phase  # story's names for the histories
    assert max_diff(notebook["params_" + phase], reference["params_" + phase]) <= TOL
    assert close(notebook[recorded], reference[recorded])


@pytest.mark.slow
def test_a_callback_given_to_fit_comes_back_with_what_the_fit_did_to_it(notebook, reference):
    assert len(notebook["step_losses"]) == 20 and close(notebook["step_losses"], reference["step_losses"])


@pytest.mark.slow
def test_validate_and_get_preds_in_the_notebook_after_remote_fits(notebook, reference):
    assert notebook["restored"] and close(notebook["validate"], reference["validate"])
    assert max_diff([notebook["preds"]], [reference["preds"]]) <= TOL


@pytest.mark.slow
def test_fits_reuse_the_same_workers(notebook):
    started, finished = notebook["pids"]
    assert started == finished and len(set(started)) == 2


@pytest.mark.slow
def test_what_users_do_after_a_fit_works_on_the_notebook_learner(notebook, tmp_path):
    """plot_loss, predict, export and load_learner (the loaded learner predicts the same), as after a local fit."""
    import matplotlib
    matplotlib.use("Agg")
    learn = tabular_digits_learner(tmp_path, bs=16).to_ddp(nprocs=2)
    learn.fit(2, 1e-2)
    learn.recorder.plot_loss()
    row = learn.dls.valid_ds.items.iloc[0]
    prediction = learn.predict(row)[2]
    learn.export("nb.pkl")
    exported = load_learner(tmp_path / "nb.pkl")
    assert max_diff(params(exported), params(learn)) == 0 and "ddp" not in vars(exported)
    assert torch.equal(prediction, exported.predict(row)[2])


class DiesOnRank1(Callback):
    order = 55  # after the Recorder, which gathers the step's loss from every rank

    def after_batch(self):
        if self.training and self.iter == 2 and ddipp.rank() == 1:
            os._exit(3)


@pytest.mark.slow
def test_a_rank_that_dies_is_named_rank0s_training_stays_and_the_next_fit_starts_a_new_group(notebook, tmp_path):
    learn = digits_learner(digits_dls(bs=16), tmp_path / "nb").to_ddp(nprocs=2)
    learn.fit(1, 1e-2)
    workers = [p.pid for p in _groups[CPU2].procs]
    with pytest.raises(WorkerError) as raised:
        learn.fit(1, 1e-2, cbs=DiesOnRank1())
    assert f"ddipp worker rank 1 (pid {workers[1]}, cpu) exited with code 3" in str(raised.value)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in workers)
    local = digits_learner(digits_dls(bs=32), tmp_path / "one")
    local.fit(1, 1e-2)
    with pytest.raises(ValueError):
        local.fit(1, 1e-2, cbs=FailAt(rank=0, epoch=0, step=2))
    assert max_diff(params(learn), params(local)) <= TOL and close(history(learn), history(local))  # 3 steps
    learn.fit(1, 1e-2)
    assert len(history(learn)["values"]) == 1 and [p.pid for p in _groups[CPU2].procs] != workers


@pytest.mark.slow
def test_lr_find_sweeps_once_on_rank0_and_the_notebook_gets_its_suggestion(notebook, tmp_path):
    """Solo mode: after a fit with the global batch, rank 0 sweeps alone with its own batch (16), as one process does
    after the same fit (batch 32) with a sweep on batch 16."""
    remote = sweep(digits_learner(digits_dls(bs=16), tmp_path / "nb").to_ddp(nprocs=2))
    local = sweep(digits_learner(digits_dls(bs=32), tmp_path / "one"), sweep_bs=16)
    assert remote["kept"] and local["kept"] and len(remote["losses"]) == 20
    assert remote["valley"] == local["valley"] and close(remote["losses"], local["losses"])


@pytest.mark.slow
def test_unchanged_data_is_sent_once_and_new_data_again(notebook, tmp_path):
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    learn.fit(1, 1e-2)
    group = _groups[CPU2]
    learn.fit(1, 1e-2)
    assert group.last_sent["data"] == 0 and group.last_sent["call"] > 0
    learn.dls = digits_dls(bs=16, n_train=320)
    learn.fit(1, 1e-2)
    assert group.last_sent["data"] > 0 and len(learn.recorder.losses) == 10


@pytest.mark.slow
def test_the_global_batch_is_said_again_when_new_loaders_change_the_batch_size(notebook, tmp_path, capsys):
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    assert capsys.readouterr().out.count("ddipp: global batch 32 = 16 per process x 2") == 1
    learn.dls = digits_dls(bs=8)
    learn.fit(1, 1e-2)
    assert capsys.readouterr().out.count("ddipp: global batch 16 = 8 per process x 2 (an epoch takes 1/2") == 1
    learn.dls = digits_dls(bs=8, n_train=320)  # other loaders, the same batch size: nothing new to say
    learn.fit(1, 1e-2)
    assert "ddipp: global batch" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True])  # sharded, the workers hold the whole learner between fits too
def test_a_refit_sends_only_what_changed_and_every_change_is_honoured(notebook, tmp_path, shard):
    learn = wide_digits_learner(digits_dls(bs=16), tmp_path / "nb").to_ddp(nprocs=2, shard=shard)
    sent = changes_between_fits(learn, sent=lambda: _groups[CPU2].last_sent["call"])  # bytes written for the workers
    one = changes_between_fits(wide_digits_learner(digits_dls(bs=32), tmp_path / "one"))
    for after, (remote, local) in enumerate(zip(sent["params"], one["params"])):
        assert max_diff(remote, local) <= TOL, after  # unchanged, edited, loaded, frozen, new optimizer
    first, unchanged, edited, loaded, frozen, new_opt = sent["sent"]
    weights = sum(p.numel() * 4 for p in learn.model.parameters())  # 154 KB; with Adam's moments 3 times that
    # measured: 156414, 4799, 135875, 465497, 4276, 4113 bytes (the first fit has no optimizer state yet)
    assert first > weights and unchanged < 10_000 and frozen < 10_000, sent["sent"]  # the workers held the rest
    assert 64 * 4 * 512 < edited - unchanged < 2 * 64 * 4 * 512  # the edited weight alone
    assert loaded > 3 * weights and new_opt < 10_000  # load: weights and moments of before; SGD: no state


class CountsTrainingGathers(Callback):
    """Counts the all-gathers torch.distributed runs during the training batches of a fit (fastai's maybe_gather calls
    it through the module, so a wrapper set there sees them)."""
    def before_fit(self):
        self.gathers, self.steps, self.fastai_own = 0, 0, dist.all_gather

        def counted(*args, **kwargs):
            self.gathers += self.training
            return self.fastai_own(*args, **kwargs)
        dist.all_gather = counted

    def after_batch(self):
        self.steps += self.training

    def after_fit(self):
        dist.all_gather, self.fastai_own = self.fastai_own, None


@pytest.mark.slow
def test_a_training_step_waits_on_no_gather_the_recorder_smooths_the_global_loss(notebook, reference, tmp_path):
    """DistributedCallback makes each step's loss the global batch's on every rank: fastai's Recorder need not gather
    it again (a blocking all-gather each step); its smoothed losses stay one process's (the story's fits, above)."""
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    counter = CountsTrainingGathers()
    learn.fit(1, 1e-2, cbs=counter)
    assert (counter.steps, counter.gathers) == (len(learn.dls.train) // 2, 0)
    assert close(notebook["fit"]["losses"], reference["fit"]["losses"])


class SaysHello(Callback):
    def after_fit(self):
        print(f"hello from rank {ddipp.rank()}")


@pytest.mark.slow
def test_rank0_prints_and_the_results_table_show_here_like_a_local_fit(notebook, tmp_path, capsys):
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    capsys.readouterr()
    learn.fit(2, 1e-2, cbs=SaysHello())
    out = capsys.readouterr().out
    assert out.count("hello from rank") == 1 and "hello from rank 0" in out
    header = "epoch     train_loss  valid_loss  accuracy  f1_score  batch_max_prob  time"
    assert header in out and [line.split()[0] for line in out.splitlines() if line[:1].isdigit()] == ["0", "1"]


class HoldsALock(Callback):
    def after_fit(self):
        self.lock, self.best = threading.Lock(), 0.5


@pytest.mark.slow
def test_an_unpicklable_callback_attribute_is_named_and_costs_nothing_else(notebook, tmp_path, capsys):
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    holder = HoldsALock()
    before = params(learn)
    learn.fit(1, 1e-2, cbs=holder)
    assert max_diff(params(learn), before) > 0 and len(history(learn)["values"]) == 1
    assert holder.best == 0.5 and holder.lock is None
    assert "HoldsALock (learn.holds_a_lock) came back with lock set to None" in capsys.readouterr().err


@pytest.mark.slow
def test_an_unpicklable_learner_or_data_attribute_is_refused_before_the_fit_naming_its_path(notebook, tmp_path):
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    learn.handle = threading.Lock()
    with pytest.raises(TypeError) as raised:
        learn.fit(1, 1e-2)
    assert "learn.handle cannot be pickled" in str(raised.value)
    del learn.handle
    learn.dls.valid.dataset.lock = threading.Lock()
    with pytest.raises(TypeError) as raised:
        learn.fit(1, 1e-2)
    assert "learner's data to its worker processes, and learn.dls.loaders[1].dataset.lock cannot be pickled" in str(
        raised.value)
    del learn.dls.valid.dataset.lock
    before = params(learn)
    learn.fit(1, 1e-2)
    assert max_diff(params(learn), before) > 0


@pytest.mark.slow
def test_after_a_refused_first_fit_the_recorder_holds_what_a_failed_local_fit_leaves(notebook, tmp_path):
    """The refusal comes before fastai's Recorder starts its lists, a local fit's failure after: `recorder.values`
    raised AttributeError ('TabularModel' object has no attribute 'values') where one process gives []."""
    local = tabular_digits_learner(tmp_path / "one", bs=1)
    with pytest.raises(ValueError, match="more than 1 value per channel"):  # BatchNorm on one item
        local.fit(1, 1e-2)
    learn = tabular_digits_learner(tmp_path / "nb", bs=1).to_ddp(nprocs=2, split_batches=True)
    with pytest.raises(ValueError, match="split_batches=True splits each batch of bs=1 over 2 processes"):
        learn.fit(1, 1e-2)
    assert history(learn) == history(local) == dict(values=[], losses=[], lrs=[])


class FailOnRank1(Callback):
    def after_batch(self):
        if self.training and self.iter == 2 and ddipp.rank() == 1:
            raise ValueError("rank 1 fails on purpose")


@pytest.mark.slow
def test_an_exception_on_a_rank_raises_here_as_itself(notebook, tmp_path):
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    with pytest.raises(ValueError) as raised:
        learn.fit(1, 1e-2, cbs=FailOnRank1())
    assert str(raised.value).endswith("rank 1 fails on purpose")  # fastai names the callback and event before it
    assert "raised on rank 1" in raised.value.__notes__[-1]
    assert "in after_batch" in str(raised.value.__cause__)


class FailAt(Callback):
    """Raises after training step `step` of `epoch` on `rank` (a local fit is rank 0), once Recorder recorded it."""
    order = 55

    def __init__(self, rank=1, epoch=1, step=5):
        self.rank, self.fail_epoch, self.step = rank, epoch, step

    def after_batch(self):
        if self.training and self.epoch == self.fail_epoch and self.iter == self.step and ddipp.rank() == self.rank:
            raise ValueError(f"rank {self.rank} fails on purpose")


def _failed_then_refit(learn, rank):
    """Fit 1 epoch, 2 failing on `rank` at step 5 of epoch 1, then 1 more: what the last two left, and whether the
    learner still has the optimizer its first fit made."""
    learn.fit(1, 1e-2)
    opt = learn.opt
    with pytest.raises(ValueError, match="fails on purpose"):
        learn.fit(2, 1e-2, cbs=FailAt(rank))
    failed = dict(history(learn), params=params(learn), epoch=learn.epoch, opt=_opt_tensors(learn))
    learn.fit(1, 1e-2)
    return failed, dict(history(learn), params=params(learn), opt=_opt_tensors(learn), same_opt=learn.opt is opt,
                        hypers=[dict(h) for h in learn.opt.hypers])


def _opt_tensors(learn):
    """The optimizer's state tensors, parameter by parameter."""
    return [t.clone() for state in learn.opt.state_dict()["state"] for t in state.values() if torch.is_tensor(t)]


class RefusesOptimizers(pickle.Unpickler):
    """Reads a part of a fit's results, any fastai optimizer in it refused (references read as None)."""

    def persistent_load(self, pid):
        return None

    def find_class(self, module, name):
        if module.startswith("fastai.optimizer"):
            raise pickle.UnpicklingError(f"the results hold a {module}.{name}")
        return super().find_class(module, name)


@pytest.mark.slow
def test_a_failed_fit_keeps_what_rank0_trained_and_the_workers_fit_on(notebook, tmp_path, capsys, monkeypatch):
    """As a local fit that fails: the weights, optimizer state and recorder of the last completed step (epoch 0 and 6
    steps of epoch 1), learn.epoch 1; the same workers run the next fit, which goes on as one process goes on. The
    optimizer's state comes back into the learner's own optimizer, never the workers' optimizer object."""
    weights = []  # the first part of each fit's results: the weights and the optimizer's state
    monkeypatch.setattr(notebook_binding, "apply_results",
                        lambda learn, parts, *args: weights.append(parts[0]) or apply_results(learn, parts, *args))
    learn = digits_learner(digits_dls(bs=16), tmp_path / "nb").to_ddp(nprocs=2)
    workers = [p.pid for p in _groups[CPU2].procs]
    failed, refit = _failed_then_refit(learn, rank=1)
    err = capsys.readouterr().err
    local_failed, local_refit = _failed_then_refit(digits_learner(digits_dls(bs=32), tmp_path / "one"), rank=0)
    steps = 20 + 6  # 20 steps an epoch
    assert len(failed["values"]) == 1 and len(failed["losses"]) == steps and failed["epoch"] == 1
    assert close({k: failed[k] for k in ("values", "losses", "lrs", "epoch")},
                 {k: local_failed[k] for k in ("values", "losses", "lrs", "epoch")})
    assert max_diff(failed["params"], local_failed["params"]) <= TOL
    assert len(failed["opt"]) == len(local_failed["opt"]) > 0 and max_diff(failed["opt"], local_failed["opt"]) <= TOL
    assert (f"ddipp: the fit failed on rank 1; the learner keeps what rank 0 trained up to its last completed step "
            f"(step {steps} of the fit, in epoch 1)") in err
    assert [p.pid for p in _groups[CPU2].procs] == workers
    assert max_diff(refit["params"], local_refit["params"]) <= TOL and close(refit["values"], local_refit["values"])
    assert refit["same_opt"] and local_refit["same_opt"] and close(refit["hypers"], local_refit["hypers"])
    assert len(refit["opt"]) == len(local_refit["opt"]) > 0 and max_diff(refit["opt"], local_refit["opt"]) <= TOL
    assert len(weights) == 3 and all(RefusesOptimizers(io.BytesIO(part)).load()["state"] for part in weights)


@pytest.mark.slow
def test_a_failed_sharded_fit_leaves_the_learner_as_it_was_before_it_and_says_so(notebook, tmp_path, capsys):
    """A sharded fit's rank 0 holds only its part of what it trained: the learner is as before the fit, as its own
    workers' are, and the next fit goes on from there as one process does after the same first fit."""
    learn = digits_learner(digits_dls(bs=16), tmp_path / "nb").to_ddp(nprocs=2, shard=True)
    learn.fit(1, 1e-2)
    before = params(learn)
    with pytest.raises(ValueError, match="fails on purpose"):
        learn.fit(2, 1e-2, cbs=FailAt(1))
    assert "ddipp: the fit did not complete; the learner here is as it was before it" in capsys.readouterr().err
    assert max_diff(params(learn), before) == 0
    learn.fit(1, 1e-2)
    local = digits_learner(digits_dls(bs=32), tmp_path / "one")
    local.fit(1, 1e-2)
    local.fit(1, 1e-2)
    assert max_diff(params(learn), params(local)) <= 1e-6


class DiesOnRank0(Callback):
    """Rank 0 killed at its third step of epoch 1, after its Checkpoint wrote the state after epoch 1 (the
    last test on the module's group, which dies with it)."""

    def after_batch(self):
        if self.training and self.epoch == 1 and self.iter == 2 and ddipp.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_fit_whose_rank0_dies_keeps_its_checkpoint_file_and_says_so(notebook, tmp_path, capsys):
    """Nothing comes back from a dead rank 0: the learner went back to its weights of before the fit although the
    fit's Checkpoint had written the state after epoch 1."""
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=2)
    before = params(learn)
    with pytest.raises(WorkerError, match="rank 0"):
        learn.fit(2, 1e-2, cbs=[ddipp.Checkpoint("kept"), DiesOnRank0()])
    file = tmp_path / "models" / "kept.pth"
    state = torch.load(file, weights_only=True)
    assert state["epoch"] == 1 and max_diff(params(learn), before) > 0
    assert max_diff(params(learn), [state["model"][name] for name, _ in learn.model.named_parameters()]) == 0
    assert history(learn)["losses"] == [float(v) for v in state["recorder"]["losses"]]
    assert len(history(learn)["values"]) == 1
    assert torch.equal(learn.opt.state_dict()["state"][0]["grad_avg"], state["opt"]["state"][0]["grad_avg"])
    said = capsys.readouterr().err
    assert (f"the learner keeps the state of the fit's Checkpoint file {file}, written after epoch 1 (step "
            f"{len(state['recorder']['losses'])} of the fit): rank 0 sent nothing back") in said


@pytest.mark.slow
def test_an_interrupt_stops_every_rank_keeps_what_was_trained_and_a_killed_notebook_leaves_no_worker(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(WORKERS / "notebook_parent.py"), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = iter(proc.stdout)
        workers = [int(pid) for pid in _after(lines, "WORKERS")]
        _after(lines, "TRAINING")
        proc.send_signal(signal.SIGINT)
        trained, epochs, steps = _after(lines, "INTERRUPTED")
        assert trained == "True" and epochs == "0" and int(steps) >= 3  # as a local fit: the steps taken, kept
        epochs, *refit = _after(lines, "REFIT")
        assert epochs == "1" and list(map(int, refit)) == workers  # the same workers went on
        _after(lines, "TRAINING")
        proc.kill()
        proc.wait()
        alive = [psutil.Process(pid) for pid in workers if psutil.pid_exists(pid)]
        assert psutil.wait_procs(alive, timeout=15)[1] == []
    finally:
        proc.kill()
        proc.wait()


class InterruptTheNotebook(Callback):
    """After training step `step` of the first epoch, rank 0 interrupts the notebook (the process that made this
    callback), as the kernel's interrupt button does."""
    order = 55

    def __init__(self, step=3):
        self.step, self.notebook = step, os.getpid()

    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter == self.step and ddipp.rank() == 0:
            os.kill(self.notebook, signal.SIGINT)


@pytest.mark.slow
def test_an_interrupt_stops_a_group_of_one_process_and_keeps_what_it_trained(tmp_path):
    """A group of one trains as plain fastai (no DDP below 2 ranks); the interrupt stops it all the same."""
    learn = digits_learner(digits_dls(bs=16), tmp_path).to_ddp(nprocs=1)
    before = params(learn)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a CI job may start with SIGINT ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            learn.fit(50, 1e-3, cbs=InterruptTheNotebook(step=3))  # more than the 4 s the interrupt waits
    finally:
        signal.signal(signal.SIGINT, previous)
    steps_per_epoch = 40
    steps = len(getattr(learn.recorder, "losses", []))  # none: the learner is as before the fit, which was killed
    assert 4 <= steps < steps_per_epoch and max_diff(params(learn), before) > 0
    learn.from_ddp()


def _after(lines, word):
    """The words after `word` on the first line of the process's output that contains it."""
    for line in lines:
        if word in line:
            return line.split(word, 1)[1].split()
    raise AssertionError(f"the process ended without printing {word}")
