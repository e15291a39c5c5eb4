"""Notebook mode: a learner bound with to_ddp(nprocs=2) in this plain process fits on a worker group and
gets back what a launched run and one process (the `ranks` and `reference` fixtures) get."""
import re

import pytest
import torch

from ddipp.interactive.group import _groups
from scenario import TOL, between_fits, close, digits_data, digits_learner, max_diff, params, story

CPU2 = ("cpu", "cpu")


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The scenario's story played by a notebook-mode learner (per-rank batch 16), and the workers' pids."""
    learn = digits_learner(digits_data(tmp_path_factory.mktemp("nb"), bs=16)).to_ddp(nprocs=2)
    pids = [p.pid for p in _groups[CPU2].procs]
    res = story(learn)
    res["pids"] = pids, [p.pid for p in _groups[CPU2].procs]
    return res


@pytest.mark.parametrize("stage", ["params_fit", "params_frozen", "params_unfrozen", "params_loaded"])
def test_the_notebook_learner_gets_the_weights_a_launched_run_and_one_process_train(notebook, ranks, reference,
                                                                                     stage):
    (r0, _), _ = ranks
    assert max_diff(notebook[stage], r0["story"][stage]) == 0
    assert max_diff(notebook[stage], reference[stage]) <= TOL


@pytest.mark.parametrize("stage", ["fit", "fit_frozen", "fit_unfrozen", "sweep_before", "sweep_after"])
def test_the_notebook_recorder_is_the_launched_one(notebook, ranks, stage):
    (r0, _), _ = ranks
    assert notebook[stage] == r0["story"][stage]


def test_validate_and_get_preds_in_the_notebook_after_remote_fits(notebook, reference):
    assert notebook["plot"] and notebook["restored"]
    assert close(notebook["validate"], reference["validate"])
    assert max_diff([notebook["preds"]], [reference["preds"]]) <= TOL


def test_fits_reuse_the_same_workers(notebook):
    started, finished = notebook["pids"]
    assert started == finished and len(set(started)) == 2


def test_changes_made_between_fits_are_honoured(tmp_path):
    group_fits = between_fits(digits_learner(digits_data(tmp_path / "nb", bs=16)).to_ddp(nprocs=2), bs=16)
    single = between_fits(digits_learner(digits_data(tmp_path / "one", bs=32)), bs=32)
    assert group_fits["batches"] == single["batches"] == 2 * ((1797 - 101) // 32)  # the last fit: 2 epochs
    assert len(group_fits["metrics"][-1]) == 3  # accuracy, FBeta and the lambda, over 101 items
    assert close({k: v for k, v in group_fits.items() if k not in ("params", "opt_state")},
                 {k: v for k, v in single.items() if k not in ("params", "opt_state")})
    assert max_diff(group_fits["params"], single["params"]) <= TOL
    assert max_diff(group_fits["opt_state"], single["opt_state"]) <= TOL  # Adam's moments came back too


def test_a_notebook_that_seeds_torch_gets_the_same_numbers_run_after_run(tmp_path):
    def seeded_run():
        learn = digits_learner(digits_data(tmp_path, bs=16, shuffle=True)).to_ddp(nprocs=2)
        torch.manual_seed(7)
        learn.fit(1, 1e-2)
        return params(learn)
    assert max_diff(seeded_run(), seeded_run()) == 0


def test_unchanged_data_is_sent_once(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    group = _groups[CPU2]
    learn.fit(1, 1e-2)
    first = group.last_sent
    learn.fit(1, 1e-2)
    again = group.last_sent
    learn.data = digits_data(tmp_path, bs=16)  # an equal copy: nothing to send either
    learn.fit(1, 1e-2)
    assert first["data"] > 400_000 and again["data"] == 0 and group.last_sent["data"] == 0
    assert 0 < again["call"] < first["data"] / 10


def test_rank0_prints_and_the_results_table_show_here_like_a_local_fit(tmp_path, capsys):
    import ddipp
    from fastai.basic_train import LearnerCallback

    class Hello(LearnerCallback):
        def on_train_begin(self, **kwargs):
            print(f"hello from rank {ddipp.rank()}")

    local = digits_learner(digits_data(tmp_path, bs=32))
    local.callback_fns.append(Hello)
    local.fit(2, 1e-2)
    local_out = capsys.readouterr().out
    learn = digits_learner(digits_data(tmp_path, bs=16)).to_ddp(nprocs=2)
    learn.callback_fns.append(Hello)
    learn.fit(2, 1e-2)
    remote_out = capsys.readouterr().out
    assert remote_out.count("hello from rank 0") == 1 and "hello from rank 1" not in remote_out

    header = "epoch     train_loss  valid_loss  accuracy  batch_max_prob  f_beta    time"
    assert remote_out.count(header) == local_out.count(header) == 1

    def epochs(out):  # the first column of the table's rows
        return re.findall(r"(\d+) +\d+\.\d{6} +\d+\.\d{6} +\d\.\d{6} +\d\.\d{6} +\d\.\d{6} +\d\d:\d\d", out)
    assert epochs(remote_out) == epochs(local_out) == ["0", "1"]
    assert "Epoch 2/2" in remote_out and "[44/44" in remote_out  # the console bars, with rank 0's batches


def test_a_language_model_trains_in_notebook_mode_as_one_process_does(tmp_path):
    import apps  # the text task of tests/test_apps.py (tests/workers)

    def trained(learn):
        learn.callback_fns.append(apps.ResetBeforeValidation)
        learn.fit_one_cycle(4, 2e-2)
        return float(learn.recorder.metrics[-1][0])
    notebook = trained(apps.lm_learner(tmp_path / "nb", bs=16).to_ddp(nprocs=2))  # 2 ranks × 16 streams
    one = trained(apps.lm_learner(tmp_path / "one", bs=32))
    assert abs(notebook - one) <= 0.03 and notebook >= 0.70, (notebook, one)  # tests/test_apps.py's bar for LM
