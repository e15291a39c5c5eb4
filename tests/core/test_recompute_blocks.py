"""ddipp.core.recompute in one process: recomputed blocks train bitwise as plain ones (parameters, BatchNorm buffers,
dropout draws) while keeping fewer bytes for backward; plain torch checkpointing, the reference of the defect, does
not."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddipp.core.recompute import recompute_names, recomputing


def convnet() -> nn.Module:
    torch.manual_seed(0)
    block = lambda c_in, c_out: nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                                              nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())
    return nn.Sequential(nn.Sequential(block(1, 8), block(8, 8)),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 10)))


def train(model: nn.Module, steps: int = 5, saved: list = None, autocast: bool = False) -> nn.Module:
    """`steps` of SGD on fixed batches (forward and loss in bfloat16 with `autocast`); the bytes autograd saved for
    backward in each step go to `saved`."""
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        count = [0]

        def pack(t):
            count[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if saved is not None:
            saved.append(count[0])
    return model


def state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_recomputed_blocks_train_bitwise_as_plain_ones_with_batchnorm_and_dropout_and_keep_fewer_bytes():
    plain_saved, recomputed_saved = [], []
    plain = state(train(convnet(), saved=plain_saved))
    model = convnet()
    names = recompute_names(model, None)
    assert names == ["0.0", "0.1", "1.3"]  # the body's blocks and the head's layers with parameters
    undo = recomputing(model, names)
    recomputed = state(train(model, saved=recomputed_saved))
    assert list(recomputed) == list(plain)  # no key renamed
    for key in plain:
        assert torch.equal(recomputed[key], plain[key]), key
    assert recomputed["0.0.1.num_batches_tracked"].item() == 5
    assert recomputed_saved[0] < plain_saved[0] / 2, (recomputed_saved, plain_saved)
    undo()
    assert all("forward" not in vars(m) for m in model.modules())


def test_under_mixed_precision_too():
    """The recomputation runs under the autocast its forward ran under (here CPU bfloat16): the same numbers."""
    plain = state(train(convnet(), autocast=True))
    model = convnet()
    recomputing(model, recompute_names(model, None))
    recomputed = state(train(model, autocast=True))
    assert all(torch.equal(recomputed[k], plain[k]) for k in plain)
    assert not torch.equal(plain["1.3.weight"], state(train(convnet()))["1.3.weight"])  # bfloat16 ran


def test_plain_checkpointing_updates_batchnorm_twice():
    """The defect Recompute exists for (pytorch#96136), on this torch: the same fit through torch's checkpoint."""
    plain = state(train(convnet()))
    model = convnet()
    for block in model[0]:
        block.forward = lambda x, block=block: checkpoint(type(block).forward, block, x, use_reentrant=False)
    checkpointed = state(train(model))
    assert checkpointed["0.0.1.num_batches_tracked"].item() == 10
    assert not torch.equal(checkpointed["0.0.1.running_mean"], plain["0.0.1.running_mean"])


def test_a_deep_copy_recomputes_its_own_blocks():
    """A sharded fit trains a deep copy of the model (ddipp.core.shard): its blocks' forwards are the copy's."""
    model = convnet()
    recomputing(model, recompute_names(model, None))
    twin = copy.deepcopy(model)
    assert twin[0][0].forward.block is twin[0][0]
    trained, plain = state(train(twin)), state(train(convnet()))
    assert all(torch.equal(trained[k], plain[k]) for k in plain)
    assert all(torch.equal(v, convnet().state_dict()[k]) for k, v in model.state_dict().items())  # untouched


def test_a_module_outside_the_model_is_refused_with_its_type():
    with pytest.raises(ValueError, match=r"a Linear that is not a submodule of the model \(Sequential\)"):
        recompute_names(convnet(), [nn.Linear(2, 2)])
