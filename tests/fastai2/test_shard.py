"""to_ddp(shard=True) on fastai v2: workers/shard_story.py launched on 2 ranks (batch 16 each) against the same story
in one process on the global batch (32); what a rank holds during the fit; the plain files it leaves; the refusals.
The split story under shard=True (2 launched ranks, 3 notebook processes) is in test_split_batches.py."""
import sys

import pytest
import torch
from fastai.learner import load_learner

import ddipp  # noqa: F401 (adds Learner.to_ddp)
from compare import close, max_diff
from fit_story import digits_dls, digits_learner, state
from shard_story import wide_learner

SHARD_TOL = 1e-6  # a sharded fit's parameters from one process's on the global batch (issue 43)
PHASES = ["fit", "frozen", "unfrozen", "fine_tune"]
HISTORIES = ["fit", "fit_frozen", "fit_unfrozen", "fine_tune"]


@pytest.mark.slow
def test_two_sharded_ranks_train_as_one_process_on_the_global_batch(shard_launched, shard_reference):
    for rank in shard_launched[0]:
        for phase, name in zip(PHASES, HISTORIES):
            assert max_diff(rank["story"]["params_" + phase], shard_reference["story"]["params_" + phase]) <= SHARD_TOL
            assert close(rank["story"][name], shard_reference["story"][name], tol=1e-4)
        assert rank["story"]["restored"]  # the plain model and loaders are back
        assert close(rank["story"]["validate"], shard_reference["story"]["validate"])
        assert max_diff(rank["units"], shard_reference["units"]) <= SHARD_TOL  # a user's own unit
        assert max_diff(rank["clipped"], shard_reference["clipped"]) <= SHARD_TOL  # GradientClip's norm of the whole
        assert rank["buffer_refused"].endswith("during a fit with to_ddp(shard=True): rank 0 alone holds the whole "
                                               "state; save to a file name (rank 0 writes it)")
        assert shard_reference["buffer_refused"] is None  # one process saves to a buffer
        assert max_diff(rank["best"]["params"], shard_reference["best"]["params"]) <= SHARD_TOL
        assert close(rank["best"]["history"], shard_reference["best"]["history"], tol=1e-4)
        sweep, expected = rank["sweep"], shard_reference["sweep"]
        assert sweep["kept"] and sweep["lrs"] == expected["lrs"]
        assert close(sweep["losses"], expected["losses"], tol=1e-4)


@pytest.mark.slow
def test_a_rank_holds_half_the_parameters_gradients_and_optimizer_state_during_the_fit(shard_launched, shard_reference):
    whole = shard_reference["held"]
    for rank in shard_launched[0]:
        held = rank["held"]
        for kind in ("params", "grads", "opt"):
            assert held[kind] <= whole[kind] * (1 / 2 + 0.05), (kind, held[kind], whole[kind])
        assert held["params_after"] == whole["params_after"] and held["model"] == "Sequential"  # whole again


@pytest.mark.slow
def test_save_export_and_save_model_write_plain_files_one_process_loads(shard_launched, tmp_path):
    ranks, out = shard_launched
    work = out / "work"
    learn = wide_learner(digits_dls(bs=32), tmp_path)
    learn.load(work / "wide" / "models" / "saved")  # fastai's own load in a plain process
    assert max_diff([p.detach() for p in learn.model.parameters()], ranks[0]["saved"]) == 0
    exported = load_learner(work / "tabular" / "exported.pkl")
    assert max_diff(state(exported), ranks[0]["exported"]) == 0  # BatchNorm's statistics too
    assert not any(type(cb).__module__.startswith("ddipp") for cb in exported.cbs)
    best = torch.load(work / "best" / "models" / "best.pth", weights_only=True)
    assert all(type(v) is torch.Tensor for v in best.values())  # not a DTensor of rank 0's part
    assert max_diff(list(best.values()), ranks[0]["best"]["params"]) == 0  # the best epoch, loaded at the end


@pytest.mark.slow
def test_a_failed_sharded_fit_leaves_the_learner_as_it_began_and_the_next_fit_trains(shard_launched):
    for rank in shard_launched[0]:
        failed = rank["failed"]
        assert failed["raised"].endswith("failing on purpose")
        assert max_diff(failed["after"], failed["began"]) == 0
        assert max_diff(failed["next"], failed["began"]) > 1e-4


@pytest.mark.slow
def test_batchnorm_statistics_are_rank0s_on_every_rank_at_the_end_of_a_fit(shard_launched):
    ranks = shard_launched[0]
    assert max_diff(ranks[0]["batchnorm"]["buffers"], ranks[1]["batchnorm"]["buffers"]) == 0
    assert max_diff(ranks[0]["batchnorm"]["params"], ranks[1]["batchnorm"]["params"]) == 0


def test_bad_shard_options_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    learn = digits_learner(digits_dls(bs=16), tmp_path)
    with pytest.raises(ValueError, match=r"to_ddp\(shard='yes'\): True \(each process holds 1/N"):
        learn.to_ddp(nprocs=2, shard="yes")
    with pytest.raises(ValueError, match=r"shard=True, find_unused_parameters=True\): a sharded fit has no search"):
        learn.to_ddp(nprocs=2, shard=True, find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"to_ddp\(shard_units=.*\): a function of the model .* with shard=True"):
        learn.to_ddp(nprocs=2, shard_units=lambda model: [model[0]])
    empty = digits_learner(digits_dls(bs=16), tmp_path)
    empty.model = torch.nn.Sequential(torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"the model \(Sequential\) has no parameter to shard; leave shard out"):
        empty.to_ddp(nprocs=2, shard=True)
    assert "ddp" not in vars(learn) and "ddp" not in vars(empty)  # nothing bound, no worker started
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # a torch without fully_shard
    with pytest.raises(ValueError, match=r"fully_shard, which torch .* lacks: install torch >= 2.6"):
        learn.to_ddp(nprocs=2, shard=True)


@pytest.mark.slow
def test_shard_with_one_process_trains_whole_and_says_so(tmp_path, capsys):
    learn, reference = digits_learner(digits_dls(bs=16), tmp_path), digits_learner(digits_dls(bs=16), tmp_path)
    learn.to_ddp(nprocs=1, shard=True)
    assert "ddipp: to_ddp(shard=True) with 1 process: it trains as one process" in capsys.readouterr().out
    learn.fit(1, 1e-2)
    reference.fit(1, 1e-2)
    assert max_diff(list(learn.model.parameters()), list(reference.model.parameters())) <= 1e-6
