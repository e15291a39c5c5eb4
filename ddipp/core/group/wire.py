"""The wire between the notebook and its workers: messages pickled by cloudpickle, minus what must not travel.

Objects both sides already hold (the learner, its data and loaders, the model's modules and parameters,
progress bars) travel as references to the receiver's own; CUDA tensors travel through the CPU and land on
the receiver's device, so no process ever touches another's GPU; parameters travel with their gradients; CPU
tensors travel as numpy arrays whose bytes go out of band (no copy into the pickle, and equal data pickles to
equal bytes); a tensor the receiving workers already hold from their last fit travels as its digest (`HeldTensors`);
the weak references fastai's callbacks keep to their learner survive the trip; a closed file travels as None; a class
an adapter names `importable_from` a module travels as a reference to it.
What goes to every worker (a fit, its data) is written once to a shared-memory file that each maps (`broadcast`).
"""
import copyreg
import hashlib
import importlib
import io
import mmap
import os
import pickle
import re
import types
import weakref
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import AbstractSet, Any, Dict, Hashable, Iterable, List, Optional, Tuple, Union

import cloudpickle
import numpy as np
import torch
from fastprogress.fastprogress import MasterBar, ProgressBar
from torch import nn

BINDING_ATTRS = ("fit", "ddp")  # what Learner.to_ddp adds to a notebook's learner
_OBJECT_GETSTATE = getattr(object, "__getstate__", None)  # Python 3.11's; a class without its own shares it (or None)
HELD_MIN_BYTES = 1024  # a smaller tensor travels whole: naming it by digest would save next to nothing
_receiver_device = torch.device("cpu")  # where CUDA tensors land while `loads` runs
_receiver_held: Optional["HeldTensors"] = None  # the tensors a `loads` may take by digest
_SHARED = "shared"  # a message whose body is in the shared-memory file whose descriptor follows it
_ALIGN = 64  # where each part of a shared message may start: numpy's arrays on it are aligned for any dtype
_IMPORTABLE: Dict[type, Tuple[str, str]] = {}  # class -> (module, name) where the receiver imports it
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.complex64, torch.complex128, torch.int64,
                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}


def _on_receiver_device(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return tensor.to(_receiver_device).requires_grad_(requires_grad)


def grad_spec(grad: Optional[torch.Tensor]) -> Union[None, str, torch.Tensor]:
    """How a parameter's gradient travels: None, "zeros" (what fastai's zero_grad leaves; no bytes sent), or itself.
    fastai's optimizers step every parameter that has a gradient, zero or not (a frozen one included: weight decay)."""
    if grad is None or grad.any():
        return grad
    return "zeros"


def grad_from_spec(spec: Union[None, str, torch.Tensor], param: torch.Tensor) -> Optional[torch.Tensor]:
    if isinstance(spec, str):
        return torch.zeros_like(param)
    return None if spec is None else spec.to(param.device)


def _parameter(data: torch.Tensor, requires_grad: bool, grad) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad)
    param.grad = grad_from_spec(grad, param)
    return param


def _tensor_from_numpy(array: np.ndarray, requires_grad: bool) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy()).requires_grad_(requires_grad)


def _travels_as_numpy(tensor: torch.Tensor) -> bool:
    """A plain dense CPU tensor of a dtype numpy has: pickled as an array, its bytes out of band."""
    return (type(tensor) is torch.Tensor and not tensor.is_cuda and tensor.layout == torch.strided
            and tensor.dtype in _NUMPY_DTYPES and not tensor.is_conj() and not tensor.is_neg())


def tensor_digest(tensor: torch.Tensor) -> str:
    """A fingerprint of a tensor's dtype, shape, strides and values: equal on every process that holds it."""
    t = tensor.detach().cpu()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}{t.stride()}".encode(), digest_size=16)
    h.update(np.ascontiguousarray(t.numpy()).data)
    return h.hexdigest()


def _worth_naming(tensor: torch.Tensor) -> bool:
    """A tensor that can travel by digest: one that would travel as numpy, of HELD_MIN_BYTES or more."""
    return (type(tensor) is torch.Tensor and tensor.dtype in _NUMPY_DTYPES and tensor.layout == torch.strided
            and not tensor.is_conj() and not tensor.is_neg()
            and tensor.element_size() * tensor.numel() >= HELD_MIN_BYTES)


class HeldTensors:
    """The tensors a worker keeps after a fit (its model's and optimizer's state), by digest: the next fit request
    names those it needs instead of sending them. A request takes each once (a second use gets a copy); what it did
    not take is dropped, since the fit changes what it took."""

    def __init__(self):
        self.tensors: Dict[str, torch.Tensor] = {}
        self.taken: Dict[str, torch.Tensor] = {}

    def keep(self, tensors: Iterable[torch.Tensor]) -> List[str]:
        """Hold `tensors` (those worth naming) instead of what was held; their digests."""
        self.release()
        for tensor in tensors:
            if _worth_naming(tensor):
                self.tensors.setdefault(tensor_digest(tensor), tensor.detach())
        return list(self.tensors)

    def take(self, digest: str) -> torch.Tensor:
        if digest in self.tensors:
            self.taken[digest] = self.tensors.pop(digest)
            return self.taken[digest]
        if digest in self.taken:
            return self.taken[digest].clone()
        raise RuntimeError(f"ddipp: this worker holds no tensor {digest}; the notebook's record of what it holds "
                           f"is wrong (a bug: please report it)")

    def release(self) -> None:
        self.tensors, self.taken = {}, {}


def _held_tensor(digest: str, requires_grad: bool, on_receiver_device: bool) -> torch.Tensor:
    tensor = _receiver_held.take(digest)
    return (tensor.to(_receiver_device) if on_receiver_device else tensor.cpu()).requires_grad_(requires_grad)


class _Gone:
    pass


def _nothing() -> None:
    """What a closed file becomes on the receiver."""


def _weakref_to(obj: Any) -> weakref.ref:
    return weakref.ref(obj) if obj is not None else weakref.ref(_Gone())  # a dead ref stays dead


def _with_annotation_globals(func: types.FunctionType, reduced):
    """cloudpickle's reduction of `func`, its globals joined by the names its string annotations read (cloudpickle
    sends only those its code reads). A module with `from __future__ import annotations` makes them strings, which
    fastcore evaluates: fastai 2.7's `PILBase.create` (sent by value) failed on the workers with "name 'Path' is not
    defined"."""
    if reduced is NotImplemented:  # sent by reference: the receiver imports it, with its module's globals
        return reduced
    names = {name for note in func.__annotations__.values() if isinstance(note, str)
             for name in re.findall(r"[A-Za-z_]\w*", note)}
    reduced[2][1]["__globals__"].update({name: func.__globals__[name] for name in names if name in func.__globals__})
    return reduced


def _delegated_attributes(obj: Any):
    """The attributes of an instance (not a class) of a plain class (no metaclass: no enum) that forwards unknown
    attributes (`__getattr__`) and has no `__getstate__` or reduction of its own, else None. Pickle looks
    `__setstate__` up on the half-built object, whose `__getattr__` then reads an attribute not set yet and recurses
    for ever: fastai's `LanguageModelPreLoader` (so any text LM data) does that. And before Python 3.11 (no
    `object.__getstate__`) pickle takes `__getstate__` from the object, so from what it forwards to: fastai v1's
    `OptimWrapper` travelled as its torch optimizer's state."""
    cls = type(obj)
    if not (not isinstance(obj, type) and type(cls) is type and hasattr(cls, "__getattr__")
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getstate__", None) is _OBJECT_GETSTATE):
        return None
    try:
        return dict(object.__getattribute__(obj, "__dict__"))  # never through its __getattr__
    except AttributeError:
        return None


def _set_attributes(obj: Any, state: dict) -> None:
    object.__getattribute__(obj, "__dict__").update(state)


def importable_from(module: str, classes: Iterable[type]) -> None:
    """Send each of `classes` as a reference to its name in `module`, whatever its __module__ says. cloudpickle sends a
    class its __module__ does not hold by value, and the class rebuilt from it is another: fastai v2 makes its
    CancelFitException & co. in fastcore.basics's name, so a worker's `except CancelFitException` missed them."""
    _IMPORTABLE.update({cls: (module, cls.__name__) for cls in classes})


def _imported(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle with references for shared objects, CUDA tensors through the CPU, and picklable weakrefs."""

    def __init__(self, file, refs: Dict[int, Tuple[Hashable, Any]], learner: Any = None, buffers: list = None,
                 held: AbstractSet[str] = frozenset()):
        super().__init__(file, protocol=5, buffer_callback=None if buffers is None else buffers.append)
        self.refs, self.learner, self.held = refs, learner, held

    def _held_digest(self, tensor: torch.Tensor) -> Optional[str]:
        """The digest of `tensor` if the receivers hold it."""
        if not (self.held and _worth_naming(tensor)):
            return None
        found = tensor_digest(tensor)
        return found if found in self.held else None

    def persistent_id(self, obj):
        ref = self.refs.get(id(obj))
        if ref is not None:
            return ref[0]
        if isinstance(obj, MasterBar):
            return "bar"
        if isinstance(obj, ProgressBar):
            return "child_bar"
        return None

    def reducer_override(self, obj):
        if type(obj) is nn.Parameter:  # with its gradient, which torch's own pickling leaves out
            return _parameter, (obj.detach(), obj.requires_grad, grad_spec(obj.grad))
        if type(obj) is torch.Tensor and (obj.is_cuda or _travels_as_numpy(obj)):
            held = self._held_digest(obj)
            if held is not None:
                return _held_tensor, (held, obj.requires_grad, obj.is_cuda)
        if type(obj) is torch.Tensor and obj.is_cuda:
            return _on_receiver_device, (obj.detach().cpu(), obj.requires_grad)
        if _travels_as_numpy(obj):  # torch's own pickling copies the bytes and names them by address
            return _tensor_from_numpy, (obj.detach().numpy(), obj.requires_grad)
        if type(obj) is weakref.ReferenceType:
            return _weakref_to, (obj(),)
        if isinstance(obj, io.IOBase) and obj.closed:  # holds nothing to send (CSVLogger's file after a fit)
            return _nothing, ()
        if isinstance(obj, type) and obj in _IMPORTABLE:
            return _imported, _IMPORTABLE[obj]
        if obj is self.learner:
            return copyreg.__newobj__, (type(obj),), travelling_state(obj)
        if isinstance(obj, types.FunctionType):
            return _with_annotation_globals(obj, super().reducer_override(obj))
        state = _delegated_attributes(obj)
        if state is not None:  # without a __setstate__ of its own, set by _set_attributes: pickle then never asks
            setter = None if hasattr(type(obj), "__setstate__") else _set_attributes  # the object for one
            return copyreg.__newobj__, (type(obj),), state, None, None, setter
        return super().reducer_override(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, objects: Dict[Hashable, Any], buffers=None):
        super().__init__(file, buffers=buffers)
        self.objects = objects

    def persistent_load(self, pid):
        return self.objects.get(pid)


def dumps(obj: Any, objects: Dict[Hashable, Any] = None, learner: Any = None,
          buffers: list = None, held: AbstractSet[str] = frozenset()) -> bytes:
    """Pickle `obj`; the values of `objects` travel as their keys; `learner` travels without its fit-time state;
    tensors whose digest is in `held` (what the receivers hold) travel as their digest.

    With `buffers`, large arrays are appended there out of band (pickle protocol 5) instead of being copied."""
    refs = {id(o): (key, o) for key, o in (objects or {}).items() if o is not None}
    file = io.BytesIO()
    _Pickler(file, refs, learner, buffers, held).dump(obj)
    return file.getvalue()


def unpicklable_path(named: Dict[str, Any], objects: Dict[Hashable, Any]) -> str:
    """The shortest path (e.g. "learn.csv_logger.lock") to a part of the `named` objects that `dumps` cannot pickle
    while each of its own parts can: breadth first, each object visited once (no cycle is followed). Each part is tried
    alone, with the values of `objects` as references (a callback's learner does not pickle the learner again)."""
    failing = [(name, part) for name, part in named.items() if not _pickles(part, objects)]
    seen = {id(part): part for _, part in failing}  # the objects kept alive, so that no id is reused
    queue = deque(failing)
    while queue:
        path, obj = queue.popleft()
        inner = [(name, part) for name, part in _parts(obj) if not _pickles(part, objects)]
        if not inner:
            return path
        for name, part in inner:
            if id(part) not in seen:
                seen[id(part)] = part
                queue.append((path + name, part))
    return failing[0][0] if failing else ""


def _pickles(part: Any, objects: Dict[Hashable, Any]) -> bool:
    try:
        dumps(part, {key: o for key, o in objects.items() if o is not part})
        return True
    except Exception:
        return False


def _parts(obj: Any) -> list:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return [(f".{k}", v) for k, v in travelling_state(obj).items()] if hasattr(obj, "__dict__") else []


def loads(blob: bytes, objects: Dict[Hashable, Any] = None, device: torch.device = torch.device("cpu"),
          buffers=None, held: Optional[HeldTensors] = None) -> Any:
    """Unpickle what `dumps` wrote: references resolve to the values of `objects`, CUDA tensors go to `device`,
    digests to the tensors `held` kept (and it is released: what the message did not take is dropped)."""
    global _receiver_device, _receiver_held
    (_receiver_device, _receiver_held), previous = (device, held), (_receiver_device, _receiver_held)
    try:
        return _Unpickler(io.BytesIO(blob), objects or {}, buffers).load()
    finally:
        _receiver_device, _receiver_held = previous
        if held is not None:
            held.release()


def send(conn: Connection, message: tuple) -> None:
    """Send a message between the notebook and a worker by value, through `dumps` (a plain `conn.send` would pickle
    tensors with torch's shared-memory reducers, meant for processes that share multiprocessing's authkey)."""
    conn.send_bytes(dumps(message))


def broadcast(conns: List[Connection], message: tuple) -> int:
    """Send `message` to every connection at once: pickled once (its arrays, pickle buffers included, out of band) into
    one shared-memory file that each receiver maps copy-on-write (`receive`), so a learner's data or model is written
    once whatever the number of workers, and they share its pages until one writes to them. The bytes written."""
    buffers: List[pickle.PickleBuffer] = []
    parts = [memoryview(dumps(message, buffers=buffers)), *(buf.raw() for buf in buffers)]
    spans, end = [], 0
    for part in parts:
        spans.append((end, part.nbytes))
        end += -(-part.nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("ddipp-message", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, end)
        with mmap.mmap(fd, end) as file:
            for (start, size), part in zip(spans, parts):
                file[start:start + size] = part
        for conn in conns:
            send(conn, (_SHARED, spans))
            send_handle(conn, fd, None)
    finally:
        os.close(fd)
    return sum(size for _, size in spans)


def receive(conn: Connection) -> tuple:
    """The next message `send` or `broadcast` sent on `conn` (a broadcast one's arrays on the shared file's pages)."""
    message = loads(conn.recv_bytes())
    if message[0] != _SHARED:
        return message
    spans = message[1]
    fd = recv_handle(conn)
    try:
        file = mmap.mmap(fd, spans[-1][0] + spans[-1][1], flags=mmap.MAP_PRIVATE)  # a worker's writes stay its own
    finally:
        os.close(fd)
    view = memoryview(file)
    parts = [view[start:start + size] for start, size in spans]
    return loads(parts[0], buffers=parts[1:])


def digest(blob: bytes, buffers: List[pickle.PickleBuffer]) -> str:
    """A fingerprint of a pickle and its out-of-band buffers: equal data, equal digest."""
    h = hashlib.blake2b(blob, digest_size=16)
    for buf in buffers:
        h.update(buf.raw())
    return h.hexdigest()


def travelling_state(learn: Any) -> dict:
    """The learner's attributes as its class pickles them (fastai v2 leaves out its lock), without ddipp's binding
    to its worker group."""
    own = getattr(type(learn), "__getstate__", None) is not _OBJECT_GETSTATE
    return {k: v for k, v in (learn.__getstate__() if own else vars(learn)).items() if k not in BINDING_ATTRS}


def fit_request(objects: Dict[Hashable, Any], learner: Any, held: AbstractSet[str], **call) -> bytes:
    """A fit `call` (the learner, the fit's arguments) as bytes, with a seed drawn from the notebook's torch generator:
    a notebook that seeds torch gets the same shuffles, dropout and augmentations on the workers run after run, as a
    local fit would. Tensors the receiving workers `held` since their last fit travel as digests (a request is made
    for each set the ranks hold). TypeError naming the first part that cannot be pickled, and the fix."""
    call["seed"] = int(torch.randint(0, 2**31 - 1, ()))
    try:
        return dumps(call, objects=objects, learner=learner, held=held)
    except Exception as e:
        path = unpicklable_path({k: v for k, v in call.items() if k != "seed"}, {**objects, "learn": learner})
        raise _unpicklable_error("learner", path, e) from e


def pickled_data(data: Any, name: str) -> Tuple[str, bytes, list]:
    """The learner's `data` (named `name`, e.g. "learn.dls") pickled for the workers, its arrays out of band, and its
    digest: equal data, equal digest. TypeError naming the first part that cannot be pickled, and the fix."""
    buffers = []
    try:
        blob = dumps(data, buffers=buffers)
    except Exception as e:
        raise _unpicklable_error("learner's data", unpicklable_path({name: data}, {}), e) from e
    return digest(blob, buffers), blob, buffers


def _unpicklable_error(what: str, path: str, error: Exception) -> TypeError:
    return TypeError(f"ddipp sends the {what} to its worker processes, and {path} cannot be pickled ({error}); "
                     f"set it to None or delete it before the fit, or make its class picklable")


def without_unpicklable(state: dict, objects: Dict[Hashable, Any]) -> Tuple[dict, List[str]]:
    """`state` (an object's attributes) with None for each value `dumps` cannot pickle, and the names of those."""
    kept, lost = dict(state), []
    for name, value in state.items():
        try:
            dumps(value, objects)
        except Exception:
            kept[name] = None
            lost.append(name)
    return kept, lost
