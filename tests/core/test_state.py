"""ddipp.core.state, the one door to a model's and an optimizer's state: a fit's whole state read and loaded through
its Strategy on 2 DDP ranks (the `core_ranks` run) against one process on the global batch; a wrapped model's state
read and loaded as the plain model's; what a worker keeps; the optimizer's state on its parameters' device."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from compare import TOL, max_diff
from core_story import STATE_STEPS, adam, adam_steps, embedding_net, state_batches
from ddipp.core.state import full_state, kept_tensors, load_full_state, move_optimizer_state


def _flat(tree, path=""):
    """(path, leaf) of every leaf of nested dicts, lists and tuples, in order."""
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in _flat(value, f"{path}/{key}")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, value in enumerate(tree) for leaf in _flat(value, f"{path}[{i}]")]
    return [(path, tree)]


def state_diff(got: dict, expected: dict) -> float:
    """The largest difference between the tensors of two whole states (full_state's form); an AssertionError naming
    the first key, length or plain value (a learning rate, a parameter index) that differs."""
    got, expected = _flat(got), _flat(expected)
    assert [path for path, _ in got] == [path for path, _ in expected], "the states' keys or lengths differ"
    for (path, a), (_, b) in zip(got, expected):
        assert isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor), path
        assert isinstance(a, torch.Tensor) or a == b, (path, a, b)
    return max_diff(*zip(*[(a, b) for (_, a), (_, b) in zip(got, expected) if isinstance(a, torch.Tensor)]))


@pytest.fixture(scope="module")
def single():
    """The state story in one process on the global batches: the model's and Adam's state dicts after STATE_STEPS
    steps, and after one more."""
    batches, net = state_batches(), embedding_net()
    opt = adam(net)
    adam_steps(net, opt, batches[:STATE_STEPS])
    trained = copy.deepcopy(dict(model=net.state_dict(), opt=opt.state_dict()))
    adam_steps(net, opt, batches[STATE_STEPS:])
    return trained, copy.deepcopy(dict(model=net.state_dict(), opt=opt.state_dict()))


@pytest.mark.slow
def test_full_state_through_ddp_on_rank0_equals_one_process_on_the_global_batch(core_ranks, single):
    (r0, _), _ = core_ranks
    assert r0["ddp_fit"]["strategy"] == "DDP"
    got = r0["ddp_fit"]["state"]
    assert list(got["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"] and len(got["opt"]["state"]) == 4
    assert state_diff(got, single[0]) <= TOL


@pytest.mark.slow
def test_load_full_state_into_a_fresh_ddp_model_gives_every_rank_the_state_and_the_next_step_one_process_s(
        core_ranks, single):
    (r0, r1), _ = core_ranks
    for rank in (r0, r1):
        assert state_diff(rank["loaded"], r0["loaded"]) == 0  # the model and the optimizer, lr 1.0 -> 0.01 included
        assert state_diff(rank["loaded"], single[0]) <= TOL
        assert state_diff(rank["after_load"], single[1]) <= TOL


@pytest.mark.slow
def test_a_sharded_models_full_state_is_rank0s_alone_on_its_cpu_and_loads_back_from_rank0(core_ranks, single):
    """Shard gathers one tensor at a time to rank 0's CPU (rank 1 keeps nothing) and loads from rank 0's state alone
    (sent to the others); the next steps and the state gathered back at the fit's end are one process's."""
    (r0, r1), _ = core_ranks
    got = r0["shard_fit"]["state"]
    assert r0["shard_fit"]["strategy"] == "Shard" and r1["shard_fit"]["state"] is None
    tensors = [*got["model"].values(), *(t for s in got["opt"]["state"].values() for t in s.values())]
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)  # plain, not DTensors
    assert list(got["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"] and len(got["opt"]["state"]) == 4
    assert state_diff(got, single[0]) <= 1e-6
    assert state_diff(r0["shard_after_load"], single[1]) <= 1e-6 and r1["shard_after_load"] is None
    for rank in (r0, r1):
        assert state_diff(rank["shard_whole_after"], single[1]) <= 1e-6


def trained_adam() -> tuple[nn.Module, torch.optim.Adam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    return model, opt


def test_a_ddp_wrapped_model_reads_and_loads_its_state_as_the_plain_model(tmp_path):
    model, opt = trained_adam()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        state = full_state(wrapped, opt)
        assert list(state["model"]) == list(model.state_dict())  # no "module." prefix
        assert state_diff(state["opt"], opt.state_dict()) == 0
        other = fresh()
        other_opt = torch.optim.Adam(other.parameters(), lr=1.0)
        load_full_state(DistributedDataParallel(other), other_opt, state)
    finally:
        dist.destroy_process_group()
    assert state_diff(dict(model=other.state_dict(), opt=other_opt.state_dict()), state) == 0


def test_kept_tensors_are_the_models_then_the_optimizers():
    model, opt = trained_adam()
    got = list(kept_tensors(model, opt))
    expected = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]
    assert len(got) == len(expected) == 6 + 3 + 3 * 6  # 2 Linear, BatchNorm's 2 + 3 buffers; step, exp_avg(_sq) x 6
    assert [(t.data_ptr(), t.shape) for t in got] == [(t.data_ptr(), t.shape) for t in expected]  # the same storage
    assert len(list(kept_tensors(model, None))) == 9


def test_optimizer_state_moves_to_its_parameters_device_but_its_scalar_steps_stay():
    model, opt = trained_adam()
    param = next(iter(opt.state))
    state = opt.state[param]
    state["exp_avg"] = state["exp_avg"].to(torch.float64)  # stands for "elsewhere": .to(param.device) keeps dtype
    moved_to = []
    original_to = torch.Tensor.to

    class Elsewhere(torch.Tensor):  # a tensor whose device differs from its parameter's
        @property
        def device(self):
            return torch.device("meta")

        def to(self, *args, **kwargs):
            moved_to.append(args)
            return original_to(self.as_subclass(torch.Tensor), *args, **kwargs)

    state["exp_avg"] = state["exp_avg"].as_subclass(Elsewhere)
    state["step"] = state["step"].as_subclass(Elsewhere)  # 0-d: stays where it is
    move_optimizer_state(opt)
    assert moved_to == [(param.device,)]
    assert type(state["exp_avg"]) is torch.Tensor and type(state["step"]) is Elsewhere
    move_optimizer_state(None)  # a learner without an optimizer yet


def fresh() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_a_compiled_models_state_reads_and_loads_as_the_plain_models_wrapped_or_not(tmp_path):
    """torch.compile's wrapper adds `_orig_mod.` to every key: a checkpoint or a notebook's results of a compiled
    model did not load into the plain model, nor the plain model's into a compiled one."""
    model, _ = trained_adam()
    compiled = torch.compile(model, backend="eager")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for wrapped in (compiled, DistributedDataParallel(compiled)):
            assert list(full_state(wrapped, None)["model"]) == list(model.state_dict())
        into_compiled, into_plain = fresh(), fresh()
        load_full_state(DistributedDataParallel(torch.compile(into_compiled, backend="eager")), None,
                        full_state(model, None))
        load_full_state(into_plain, None, full_state(DistributedDataParallel(compiled), None))
    finally:
        dist.destroy_process_group()
    for loaded in (into_compiled, into_plain):
        assert max_diff(loaded.state_dict().values(), model.state_dict().values()) == 0
