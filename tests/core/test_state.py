"""ddipp.core.state: a wrapped model's state reads and loads as the plain model's; the optimizer's state tensors."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddipp.core.state import load_model_state, model_state, move_optimizer_state, state_tensors


def trained_adam() -> tuple[nn.Module, torch.optim.Adam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    return model, opt


def test_a_ddp_wrapped_model_reads_and_loads_its_state_as_the_plain_model(tmp_path):
    model, _ = trained_adam()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        state = model_state(wrapped)
        assert list(state) == list(model.state_dict())  # no "module." prefix
        other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        load_model_state(DistributedDataParallel(other), state)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values()))


def test_state_tensors_are_the_models_then_the_optimizers():
    model, opt = trained_adam()
    got = list(state_tensors(model, opt.state))
    expected = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]
    assert len(got) == len(expected) == 6 + 3 + 3 * 6  # 2 Linear, BatchNorm's 2 + 3 buffers; step, exp_avg(_sq) x 6
    assert [(t.data_ptr(), t.shape) for t in got] == [(t.data_ptr(), t.shape) for t in expected]  # the same storage


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
    move_optimizer_state(opt.state)
    assert moved_to == [(param.device,)]
    assert type(state["exp_avg"]) is torch.Tensor and type(state["step"]) is Elsewhere


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
            assert list(model_state(wrapped)) == list(model.state_dict())
        into_compiled, into_plain = fresh(), fresh()
        load_model_state(DistributedDataParallel(torch.compile(into_compiled, backend="eager")), model_state(model))
        load_model_state(into_plain, model_state(DistributedDataParallel(compiled)))
    finally:
        dist.destroy_process_group()
    for loaded in (into_compiled, into_plain):
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
