"""to_ddp(shard=True) on fastai v1: workers/shard_story.py launched on 2 ranks (batch 16 each) against the same story
in one process on the global batch (32). The split story under shard=True is in test_split_batches.py."""
import pytest
import torch
from fastai.basic_train import load_learner

import ddipp  # noqa: F401
from compare import close, max_diff
from scenario import digits_data, digits_learner

SHARD_TOL = 1e-6  # a sharded fit's parameters from one process's on the global batch (issue 43)


@pytest.mark.slow
def test_two_sharded_ranks_train_as_one_process_on_the_global_batch(shard_launched, shard_reference):
    for rank in shard_launched[0]:
        story, expected = rank["story"], shard_reference["story"]
        for phase in ("fit", "frozen", "unfrozen", "loaded"):
            assert max_diff(story["params_" + phase], expected["params_" + phase]) <= SHARD_TOL, phase
        for name in ("fit", "fit_frozen", "fit_unfrozen"):
            assert close(story[name], expected[name], tol=1e-4), name
        assert story["restored"] and close(story["validate"], expected["validate"])
        assert max_diff(rank["best"]["params"], shard_reference["best"]["params"]) <= SHARD_TOL
        assert close(rank["best"]["history"], shard_reference["best"]["history"], tol=1e-4)
        sweep, ref = rank["sweep"], shard_reference["sweep"]
        assert sweep["kept_weights"] and close(sweep["losses"], ref["losses"], tol=1e-4) and sweep["lrs"] == ref["lrs"]


@pytest.mark.slow
def test_a_rank_holds_half_the_parameters_gradients_and_optimizer_state_during_the_fit(shard_launched, shard_reference):
    whole = shard_reference["held"]
    for rank in shard_launched[0]:
        for kind in ("params", "grads", "opt"):
            assert rank["held"][kind] <= whole[kind] * (1 / 2 + 0.05), (kind, rank["held"][kind], whole[kind])
        assert rank["held"]["params_after"] == whole["params_after"]  # whole again after the fit


@pytest.mark.slow
def test_save_model_and_export_write_plain_files_one_process_loads(shard_launched, tmp_path):
    ranks, out = shard_launched
    best = torch.load(out / "work" / "best" / "models" / "best.pth", weights_only=True)
    assert all(type(v) is torch.Tensor for v in best["model"].values())  # not a DTensor of rank 0's part
    assert max_diff(list(best["model"].values()), ranks[0]["best"]["params"]) == 0  # the best, loaded at the end
    learn = digits_learner(digits_data(tmp_path, bs=32))
    learn.load(out / "work" / "best" / "models" / "best")  # fastai's own load, with the optimizer's state
    exported = load_learner(out / "work" / "tabular", "exported.pkl")
    assert max_diff([t.float() for t in exported.model.state_dict().values()], ranks[0]["exported"]) == 0


@pytest.mark.slow
def test_a_failed_sharded_fit_leaves_the_learner_as_it_began(shard_launched):
    for rank in shard_launched[0]:
        failed = rank["failed"]
        assert failed["raised"] == "failing on purpose" and max_diff(failed["after"], failed["began"]) == 0
