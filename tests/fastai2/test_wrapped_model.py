"""A model in torch.compile's and DDP's wrappers launched on 2 ranks (workers/wrapped_model.py, in extras_worker.py's
run): a callback reads its attributes, its Checkpoint resumes the uncompiled model and back, its learn.save loads into
the uncompiled model, and it trains as one process does."""
import pytest
from fastai.torch_core import trainable_params

from compare import TOL, max_diff
from wrapped_model import compiled_story
from extras import digits_dls, digits_learner, launched, params


@pytest.fixture
def ranks(tmp_path_factory):
    """What workers/extras_worker.py saw on each of 2 launched ranks, and its folder (one run per session)."""
    return launched(tmp_path_factory.getbasetemp())


@pytest.mark.slow
def test_launched_a_callback_reads_the_wrapped_model_and_a_compiled_state_loads_uncompiled_and_back(ranks, tmp_path):
    """torch.compile's wrapper adds `_orig_mod.` to every key of its state: the checkpoint of a compiled fit did not
    resume the uncompiled model (Missing key(s) in state_dict: "0.weight" ...), nor its learn.save load into it."""
    (rank0, rank1), out = ranks
    one_process = compiled_story(tmp_path, bs=32)
    assert rank0["compiled"]["keys"][0].startswith("_orig_mod.")  # the compiled model trained to the end
    # 'DistributedDataParallel' object has no attribute 'label' before ModelDDP; 44 steps of 32 (2 ranks x 16)
    assert rank0["compiled"]["read"] == rank1["compiled"]["read"] == one_process["read"] == ["digits"] * 44
    assert max_diff(rank0["compiled"]["params"], one_process["params"]) <= TOL
    assert max_diff(rank1["compiled"]["params"], rank0["compiled"]["params"]) == 0
    loaded = digits_learner(digits_dls(32), path=out / "compiled", splitter=trainable_params)
    loaded.load("final")
    assert max_diff(params(loaded), rank0["compiled"]["params"]) == 0
