"""`to_ddp(shard=True)`: during a fit each rank holds 1/N of the model's parameters, their gradients and the
optimizer's state (FSDP2's `fully_shard` over an explicit device mesh); when the fit ends the learner is whole again.

The user's model is never sharded itself: a copy of its modules, sharing its buffers, is (fully_shard cannot be
undone), the optimizer steps the copy's sharded parameters for the fit, and the fit's end gathers them back into the
model's own parameter objects (the optimizer pointed back at them). A fit that fails cannot gather (a peer may be
gone): it leaves the model and the optimizer as the fit began (kept on the CPU meanwhile when the device is a GPU)."""
import copy
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import dist as ddist
from .syncbn import convert_sync_bn

TORCH_NEEDED = "2.6"  # torch.distributed.fsdp.fully_shard's first release


def fully_shard_api():
    """torch's `fully_shard` and `init_device_mesh`; a ValueError naming the torch needed on one without them."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise ValueError(f"to_ddp(shard=True) shards with FSDP2's fully_shard, which torch {torch.__version__} lacks: "
                         f"install torch >= {TORCH_NEEDED}, or leave shard out (every rank holds the whole model)")
    return fully_shard, init_device_mesh


def check_shardable(model: nn.Module, processes: int) -> None:
    """ValueError for a model `shard=True` cannot shard (one without a parameter with an element); a line saying that
    one process trains whole."""
    if not any(p.numel() for p in model.parameters()):
        raise ValueError(f"to_ddp(shard=True): the model ({type(model).__name__}) has no parameter to shard; leave "
                         "shard out")
    if processes == 1:
        print("ddipp: to_ddp(shard=True) with 1 process: it trains as one process, holding the whole model (sharding "
              "needs 2 or more)")


def default_units(model: nn.Module) -> List[nn.Module]:
    """The modules sharded as one unit each (gathered whole for their forward and backward only): each block of the
    model's top-level Sequential or ModuleList children (a cnn_learner's body's blocks, its head), else each top-level
    child, when it has parameters."""
    units = []
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            units.extend(block for block in child.children() if _has_params(block))
        elif _has_params(child):
            units.append(child)
    return units


def _has_params(module: nn.Module) -> bool:
    return any(p.numel() for p in module.parameters())


class Shard:
    """Each rank holds 1/N of every parameter (dim 0), of its gradient and of its optimizer state while the fit runs;
    BatchNorm buffers are broadcast from rank 0 before every forward, as DDP does (with sync_bn they agree anyway).
    `units(model)`, if given, names the modules sharded as units (default_units otherwise)."""
    shards = True

    def __init__(self, sync_bn: bool = False, units: Optional[Callable[[nn.Module], Iterable[nn.Module]]] = None):
        self.sync_bn, self.units = sync_bn, units

    def wrap(self, model: nn.Module, optimizer: Any, undo: ExitStack) -> nn.Module:
        """A sharded copy of `model` (its buffers shared), `optimizer` stepping its parameters; `undo` gathers them
        back into `model`'s when the fit ends (or puts back where the fit began, when it raised)."""
        fully_shard, init_device_mesh = fully_shard_api()
        if self.sync_bn:
            undo.callback(convert_sync_bn(model))
        unit_names = _unit_names(model, self.units)
        device = ddist.device()
        params = dict(model.named_parameters())
        began = _Began(params, optimizer, device)
        sharded_model = _structural_copy(model)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        modules = dict(sharded_model.named_modules())
        for name in unit_names:
            fully_shard(modules[name], mesh=mesh)
        fully_shard(sharded_model, mesh=mesh)
        sharded = dict(sharded_model.named_parameters())
        to_sharded = {params[name]: sharded[name] for name in params}
        _shard_gradients(to_sharded)
        _repoint(optimizer, to_sharded)
        _shard_optimizer_state(optimizer)
        began.set_aside()
        sharded_model.register_forward_pre_hook(_broadcast_buffers)
        sharded_model.register_load_state_dict_pre_hook(_whole_to_shards)

        def end(error_type, error, traceback) -> None:
            if error_type is not None:
                began.put_back(to_sharded, optimizer)
                return
            try:
                whole = _gathered(sharded_model, params, sharded, optimizer)
            except BaseException:  # a peer gone at the very end: the fit failed after all
                began.put_back(to_sharded, optimizer)
                raise
            _take_whole(whole, params, sharded, optimizer)
        undo.push(end)
        return sharded_model

    def full_state(self, model: nn.Module, optimizer: Any) -> Optional[dict]:
        """Gathered one tensor at a time, each kept on rank 0's CPU (the other ranks hold one tensor at most)."""
        _shard_optimizer_state(optimizer)
        rank0 = dist.get_rank() == 0
        model_state = {key: _whole(value, rank0) for key, value in model.state_dict().items()}
        opt = None if optimizer is None else walk(optimizer.state_dict(), lambda value: _whole(value, rank0))
        return dict(model=model_state, opt=opt) if rank0 else None

    def load_full_state(self, model: nn.Module, optimizer: Any, state: Optional[dict]) -> None:
        """`state` as every rank passes it (each read the file), or rank 0's alone (sent to the others a tensor at a
        time); each rank keeps its shard of each tensor."""
        if not _everyone(state is not None):
            state = _from_rank0(state)
        model.load_state_dict(state["model"])
        if optimizer is not None and state.get("opt") is not None:
            optimizer.load_state_dict(state["opt"])
            _shard_optimizer_state(optimizer)


def _unit_names(model: nn.Module, units: Optional[Callable]) -> List[str]:
    """The names in `model` of the modules `units(model)` gives (default_units' without it)."""
    return names_in(model, default_units(model) if units is None else list(units(model)), lambda module: (
        f"to_ddp(shard_units={getattr(units, '__name__', units)!r}) gave a {type(module).__name__} that is not a "
        f"submodule of the model ({type(model).__name__}): give modules of learn.model, e.g. "
        "shard_units=lambda model: list(model.layers)"))


def names_in(model: nn.Module, chosen: List[nn.Module], refusal: Callable[[nn.Module], str]) -> List[str]:
    """The names in `model` of the `chosen` modules; a ValueError saying `refusal(module)` for one not in it."""
    names = {id(module): name for name, module in model.named_modules() if name}
    for module in chosen:
        if id(module) not in names:
            raise ValueError(refusal(module))
    return [names[id(module)] for module in chosen]


def _structural_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules whose parameters are new objects over the same storage, its buffers the same."""
    memo: Dict[int, Any] = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                            for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    return copy.deepcopy(model, memo)


def _repoint(optimizer: Any, mapping: Dict[nn.Parameter, nn.Parameter]) -> None:
    """Point `optimizer` (a torch optimizer, or an adapter's view with `param_groups` and `state`) at `mapping`'s
    parameters in place of its keys, the state of each going with it."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            params[i] = mapping.get(p, p)
    state = optimizer.state
    for old in [p for p in state if p in mapping]:
        state[mapping[old]] = state.pop(old)


def _shard_gradients(to_sharded: Dict[nn.Parameter, nn.Parameter]) -> None:
    """Each frozen sharded parameter gets its shard of the gradient its parameter holds: fastai keeps zeroed ones
    between fits, and its weight decay steps a frozen parameter that has one (the others' come from FSDP)."""
    for p, s in to_sharded.items():
        if p.grad is not None and not p.requires_grad:
            s.grad = _cut(p.grad, s)


def _params(optimizer: Any) -> List[nn.Parameter]:
    """The optimizer's parameters in its own order (the same on every rank)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _shard_optimizer_state(optimizer: Any) -> None:
    """Each whole state tensor of a sharded parameter (a load, or fastai's LRFinder reloading on rank 0, puts whole
    ones there) becomes this rank's shard of it, cut locally."""
    from torch.distributed.tensor import DTensor
    if optimizer is None:
        return
    for p in _params(optimizer):
        state = optimizer.state.get(p)
        if not state or not isinstance(p, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == p.shape \
                    and value.dim() > 0:
                state[key] = _cut(value, p)


def _whole_to_shards(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A whole tensor loaded into a sharded parameter becomes this rank's shard of it (a load pre-hook)."""
    from torch.distributed.tensor import DTensor
    for name, p in module.named_parameters():
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            state_dict[prefix + name] = _cut(value.to(p.dtype), p)


def _cut(whole: torch.Tensor, like: Any) -> Any:
    """This rank's shard of the whole tensor `whole`, placed as the sharded parameter `like`: cut locally, and a copy
    (a view would keep the whole tensor's memory)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None).clone()


def _broadcast_buffers(module: nn.Module, args) -> None:
    """Every rank runs the forward with rank 0's buffers (BatchNorm's running statistics), as DDP does."""
    for buffer in module.buffers():
        dist.broadcast(buffer, 0)


def _gathered(sharded_model: nn.Module, params: Dict[str, nn.Parameter], sharded: Dict[str, nn.Parameter],
              optimizer: Any) -> dict:
    """Every rank: each sharded parameter, gradient and optimizer state value gathered whole (the buffers made rank
    0's); nothing is changed, so a failure leaves the fit's start to put back."""
    from torch.distributed.tensor import DTensor
    _broadcast_buffers(sharded_model, ())
    _shard_optimizer_state(optimizer)
    params_out = {name: sharded[name].detach().full_tensor() for name in params}
    grads = {name: None if sharded[name].grad is None else sharded[name].grad.full_tensor() for name in params}
    state = {} if optimizer is None else {
        p: {key: value.full_tensor() if isinstance(value, DTensor) else value
            for key, value in optimizer.state.get(p, {}).items()} for p in _params(optimizer)}
    return dict(params=params_out, grads=grads, state=state)


def _take_whole(whole: dict, params: Dict[str, nn.Parameter], sharded: Dict[str, nn.Parameter],
                optimizer: Any) -> None:
    """The model's own parameters (and gradients) and the optimizer's state from `whole`, the optimizer pointed back
    at the model's parameters."""
    for name, p in params.items():
        p.data, p.grad = whole["params"][name], whole["grads"][name]
    if optimizer is None:
        return
    for p, values in whole["state"].items():
        if values:
            optimizer.state[p] = values
    _repoint(optimizer, {sharded[name]: p for name, p in params.items()})


class _Began:
    """The model's parameters and the optimizer's state as the fit began, kept for a fit that fails (which cannot
    gather what it trained): on the CPU during the fit when they are on a GPU."""

    def __init__(self, params: Dict[str, nn.Parameter], optimizer: Any, device: torch.device):
        self.params, self.device = params, device
        self.state = {} if optimizer is None else {p: dict(s) for p, s in optimizer.state.items()}

    def set_aside(self) -> None:
        """Off the GPU (and without gradients) while the sharded copy trains."""
        for p in self.params.values():
            p.grad = None
            if self.device.type == "cuda":
                p.data = p.data.cpu()
        if self.device.type == "cuda":
            self.state = {p: walk(s, lambda t: t.cpu()) for p, s in self.state.items()}

    def put_back(self, to_sharded: Dict[nn.Parameter, nn.Parameter], optimizer: Any) -> None:
        for p in self.params.values():
            p.data = p.data.to(self.device)
        if optimizer is None:
            return
        _repoint(optimizer, {s: p for p, s in to_sharded.items()})
        state = optimizer.state
        for p in list(state):
            del state[p]
        state.update({p: walk(s, lambda t: t.to(self.device)) for p, s in self.state.items()})


def walk(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with `fn` applied to each tensor (or _Spec) in its dicts, lists and tuples."""
    if isinstance(value, (torch.Tensor, _Spec)):
        return fn(value)
    if isinstance(value, dict):
        return {k: walk(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        walked = [walk(v, fn) for v in value]
        return tuple(walked) if isinstance(value, tuple) else walked
    return value


def _whole(value: Any, keep: bool) -> Any:
    """A sharded tensor gathered whole (every rank calls), on the CPU where `keep`, else dropped (None)."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu() if keep else None


@dataclass(frozen=True)
class _Spec:
    """A tensor's shape and dtype, sent ahead of its values."""
    shape: tuple
    dtype: torch.dtype


def _everyone(flag: bool) -> bool:
    """Whether `flag` holds on every rank."""
    agreed = torch.tensor([int(flag)], device=ddist.device())  # where the backend's collectives work
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def _from_rank0(state: Optional[dict]) -> dict:
    """Rank 0's `state` on every rank: its layout (shapes, dtypes, other values) sent first, then each tensor."""
    rank0, device = dist.get_rank() == 0, ddist.device()
    layout = [walk(state, lambda t: _Spec(tuple(t.shape), t.dtype)) if rank0 else None]
    dist.broadcast_object_list(layout, src=0)

    def sent(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(device)
        dist.broadcast(moved, 0)
        return t

    def received(spec: _Spec) -> torch.Tensor:
        t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        dist.broadcast(t, 0)
        return t
    return walk(state, sent) if rank0 else walk(layout[0], received)
