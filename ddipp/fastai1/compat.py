"""The smallest fixes that make fastai 1.0.61 run on torch 2.14 / numpy 2 / pandas 3 / spacy 3.

Each fix checks that the old behaviour is really gone before it changes anything, says what breaks
and why, and is applied once by `apply()` (called on `import ddipp`; a fix of one of fastai's applications once
that application is imported). docs/fastai1-compat.md lists them.
"""
import contextlib
import gc
import importlib.metadata
import importlib.util
import inspect
import io
import os
import re
import sys
import warnings
from collections.abc import Sized
from functools import partial
from pathlib import Path
from typing import Callable
from warnings import warn

import numpy as np
import pandas as pd
import torch
from fastprogress.fastprogress import ConsoleMasterBar, ConsoleProgressBar
from torch import nn

# setuptools 80 warns (a UserWarning: "pkg_resources is deprecated as an API") on `import pkg_resources`, which every
# `import fastai` runs (fastai.imports.core calls its `require`). Import it here first, with exactly that warning
# ignored, so fastai's import is quiet when ddipp is imported before fastai. Nothing else is silenced, and nothing at
# all if pkg_resources was already imported.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated as an API", category=UserWarning)
    import pkg_resources  # noqa: F401

import fastai.basic_data
import fastai.basic_train
import fastai.core
import fastai.data_block
import fastai.train  # also adds fit_one_cycle, lr_find, to_fp16 to Learner
from fastai.basic_data import data_collate, distrib_barrier, is_pathlike
from fastai.basic_train import LabelLists, load_callback
from fastai.callback import OptimWrapper
from fastai.core import defaults, get_tmp_file, ifnone


def _version(distribution: str) -> tuple:
    """(major, minor) of an installed distribution, read without importing it (fastai's applications import spacy and
    torchvision's models, which import torch._dynamo: 1.5-3 s that a plain or tabular script need not pay)."""
    return tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version(distribution))[:2])


_TORCH_LOADS_WEIGHTS_ONLY = torch.__version__ >= (2, 6)   # torch.load(weights_only=True) became the default
_NUMPY_REJECTS_RAGGED = np.lib.NumpyVersion(np.__version__) >= "1.24.0"
_PANDAS_2 = int(pd.__version__.split(".")[0]) >= 2
_SPACY_3 = _version("spacy") >= (3,)
_TORCHVISION_WEIGHTS_API = _version("torchvision") >= (0, 13)

_applied = False


def apply() -> None:
    """Apply every fix whose broken behaviour is present; calling it again does nothing."""
    global _applied
    if _applied:
        return
    _applied = True
    if _TORCH_LOADS_WEIGHTS_ONLY:
        _allow_numpy_scalars_in_weights_only_load()
        _rebody(fastai.basic_train.load_learner, _load_learner)
        _rebody(fastai.basic_data.load_data, _load_data)
        _rebody(fastai.data_block.LabelLists.load_empty.__func__, _label_lists_load_empty)
        _rebody(fastai.basic_train.Learner.purge, _purge)
    # fastai's applications are patched once imported: ddipp imports none of them (a tabular script pays for no
    # spacy or vision models)
    if _torch_solve_removed():
        _when_imported("fastai.vision.transform", _fix_solve)
    if _PANDAS_2:
        _when_imported("fastai.tabular.transform", _fix_tabular_transform)
    if _SPACY_3:
        _when_imported("fastai.text.transform", _fix_spacy_tokenizer)
    _restore_numpy_aliases()
    if _NUMPY_REJECTS_RAGGED:
        _replace_in_fastai_modules(fastai.core.array, _array)
        _when_imported("fastai.text.data", _fix_sortish_sampler)
    if _inplace_on_a_chunk_fails():
        _when_imported("fastai.text.models.qrnn", _fix_qrnn)
    _restore_ipython_display()
    if _row_follows_a_cut_bar():
        ConsoleMasterBar.write = _write_on_a_fresh_line
    if _pinning_warns():
        _no_pinning_by_default(fastai.basic_data.intercept_args)
    if _TORCHVISION_WEIGHTS_API:
        _when_imported("fastai.vision.learner", _fix_create_body)
    if _zero_grad_sets_none():
        fastai.train.AccumulateScheduler.on_epoch_end = _accumulate_scheduler_on_epoch_end


def _rebody(old, new) -> None:
    """Give function `old` the code of `new`, so references taken before `import ddipp` get the fix too.

    `new` runs with `old`'s module globals: it may only use names that module defines (those compat does not import
    are marked `noqa: F821`)."""
    old.__code__ = new.__code__


def _when_imported(name, patch) -> None:
    """Call `patch(module)` once module `name` is imported: now if it is, else right after its import runs."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchAfterImport(name, patch))


class _PatchAfterImport:
    """Import finder for one module (too costly to import eagerly) that patches it right after it ran."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def run_and_patch(module):
            run(module)
            self.patch(module)
        spec.loader.exec_module = run_and_patch
        return spec


def _replace_in_fastai_modules(old, new) -> None:
    """Rebind `old` to `new` in every loaded fastai module (they copied it with `from ..core import *`)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("fastai") and getattr(module, old.__name__, None) is old:
            setattr(module, old.__name__, new)


# --- torch >= 2.6: torch.load defaults to weights_only=True -----------------------------------------
# fastai's Learner.save stores the optimizer state, whose hyper-parameters are numpy scalars after
# fit_one_cycle/lr_find; the weights-only unpickler rejects them ("Unsupported global:
# numpy._core.multiarray.scalar"), so Learner.load, lr_find's final reload and SaveModelCallback fail.
# Allow exactly those numpy types; torch.load stays weights-only for everything else.
def _allow_numpy_scalars_in_weights_only_load() -> None:
    dtype_classes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    scalar = np._core.multiarray.scalar if hasattr(np, "_core") else np.core.multiarray.scalar
    torch.serialization.add_safe_globals([scalar, np.dtype, *dtype_classes])


# load_learner and load_data unpickle a whole Learner / DataBunch (classes, functions, partials) by
# design, which a weights-only load can never allow. These two calls alone load with
# weights_only=False: load only files you trust, as with any pickle.
def _load_learner(path, file="export.pkl", test=None, tfm_y=None, **db_kwargs):
    "Load a `Learner` exported with `Learner.export` (a full pickle: load only files you trust)."
    source = Path(path)/file if is_pathlike(file) else file
    distrib_barrier()  # as fastai's load_data and Learner.load: under DDP, wait until rank 0 has exported
    map_location = "cpu" if defaults.device == torch.device("cpu") else None
    state = torch.load(source, map_location=map_location, weights_only=False)
    model = state.pop("model")
    src = LabelLists.load_state(path, state.pop("data"))
    if test is not None: src.add_test(test, tfm_y=tfm_y)
    data = src.databunch(**db_kwargs)
    cb_state = state.pop("cb_state")
    clas_func = state.pop("cls")
    res = clas_func(data, model, **state)
    res.callback_fns = state["callback_fns"]
    res.callbacks = [load_callback(c, s, res) for c, s in cb_state.items()]
    return res


def _load_data(path, file="data_save.pkl", bs=64, val_bs=None, num_workers=defaults.cpus, dl_tfms=None,
               device=None, collate_fn=data_collate, no_check=False, **kwargs):
    "Load a `DataBunch` saved with `DataBunch.save` (a full pickle: load only files you trust)."
    source = Path(path)/file if is_pathlike(file) else file
    distrib_barrier()
    map_location = "cpu" if defaults.device == torch.device("cpu") else None
    ll = torch.load(source, map_location=map_location, weights_only=False)
    return ll.databunch(path=path, bs=bs, val_bs=val_bs, num_workers=num_workers, dl_tfms=dl_tfms, device=device,
                        collate_fn=collate_fn, no_check=no_check, **kwargs)


# LabelLists.load_empty (hence DataBunch.load_empty, fastai's way to rebuild data for inference) reads the
# state `export` wrote: classes, processors, transforms. Same trust as load_learner.
def _label_lists_load_empty(cls, path, fn="export.pkl"):
    "Create a `LabelLists` with empty sets from the serialized file in `path/fn` (a full pickle: trusted files only)."
    path = Path(path)
    return LabelLists.load_state(path, torch.load(path/fn, weights_only=False))


# Learner.purge (and Learner.load(purge=True)) pickles the learner's attributes to a temporary file and reads
# them back at once: the file is its own, so it loads with weights_only=False.
def _purge(self, clear_opt=True):
    "Purge the `Learner` of all cached attributes to release some GPU memory."
    self._test_writeable_path()
    attrs_all = [k for k in self.__dict__.keys() if not k.startswith("__")]
    attrs_pkl = ["bn_wd", "callback_fns", "layer_groups", "loss_func", "metrics", "model",
                 "model_dir", "opt_func", "path", "train_bn", "true_wd", "wd"]
    attrs_keep = ["data", "recorder"]
    attrs_del = list(set(attrs_all) - set(attrs_keep))
    state = {a: getattr(self, a) for a in attrs_pkl}
    state["cb_state"] = {cb.__class__: cb.get_state() for cb in self.callbacks}
    if hasattr(self, "opt"): state["opt"] = self.opt.get_state()
    tmp_file = get_tmp_file(self.path/self.model_dir)
    torch.save(state, tmp_file)
    for a in attrs_del: delattr(self, a)
    gc.collect()
    state = torch.load(tmp_file, weights_only=False)
    os.remove(tmp_file)
    for a in attrs_pkl: setattr(self, a, state[a])
    cb_state = state.pop("cb_state")
    self.callbacks = [load_callback(c, s, self) for c, s in cb_state.items()]
    if not clear_opt and "opt" in state:
        try: self.opt = OptimWrapper.load_with_state_and_layer_group(state["opt"], self.layer_groups)
        except Exception: warn("Wasn't able to properly load the optimizer state again.")
    del state
    gc.collect()
    return self


# --- torch.solve was removed (it now raises) ---------------------------------------------------------
# fastai's perspective warp (get_transforms(max_warp=0.2), the default, and TTA) solves an 8x8 system
# with torch.solve(B, A); torch.linalg.solve(A, B) is its replacement.
def _torch_solve_removed() -> bool:
    try:
        torch.solve(torch.eye(1), torch.eye(1))
    except (AttributeError, RuntimeError):
        return True
    return False


def _solve(B, A):
    return (torch.linalg.solve(A, B),)


def _fix_solve(transform) -> None:
    transform._solve_func = _solve


# --- pandas >= 2 --------------------------------------------------------------------------------------
# `df.loc[:, n] = categorical` now writes values into the existing column and keeps its dtype, so
# Categorify's `df[n].cat` raises "Can only use .cat accessor with a 'category' dtype" (tabular, collab).
def _categorify_apply_train(self, df):
    "Transform `self.cat_names` columns in categorical."
    self.categories = {}
    for n in self.cat_names:
        df[n] = df[n].astype("category").cat.as_ordered()
        self.categories[n] = df[n].cat.categories


def _categorify_apply_test(self, df):
    "Transform `self.cat_names` columns in categorical using the codes decided in `apply_train`."
    for n in self.cat_names:
        df[n] = pd.Categorical(df[n], categories=self.categories[n], ordered=True)


# add_datepart (Rossmann): pandas 2 removed `Series.dt.week` and `infer_datetime_format`, pandas 3's
# string dtype makes `np.issubdtype` raise, and datetimes are no longer always nanoseconds, so
# `astype(int64) // 10**9` is not seconds any more.
def _fix_tabular_transform(transform) -> None:
    transform.Categorify.apply_train = _categorify_apply_train
    transform.Categorify.apply_test = _categorify_apply_test
    _rebody(transform.make_date, _make_date)
    _rebody(transform.add_datepart, _add_datepart)


def _make_date(df, date_field):
    "Make sure `df[date_field]` is of the right date type."
    if not pd.api.types.is_datetime64_any_dtype(df[date_field]):
        df[date_field] = pd.to_datetime(df[date_field])


def _add_datepart(df, field_name, prefix=None, drop=True, time=False):
    "Helper function that adds columns relevant to a date in the column `field_name` of `df`."
    make_date(df, field_name)  # noqa: F821  (fastai.tabular.transform.make_date, itself fixed above)
    field = df[field_name]
    prefix = ifnone(prefix, re.sub("[Dd]ate$", "", field_name))
    attr = ["Year", "Month", "Week", "Day", "Dayofweek", "Dayofyear", "Is_month_end", "Is_month_start",
            "Is_quarter_end", "Is_quarter_start", "Is_year_end", "Is_year_start"]
    if time: attr = attr + ["Hour", "Minute", "Second"]
    for n in attr:
        if n == "Week": df[prefix + n] = field.dt.isocalendar().week.astype(field.dt.day.dtype)
        else: df[prefix + n] = getattr(field.dt, n.lower())
    df[prefix + "Elapsed"] = (field - pd.Timestamp(0, tz=field.dt.tz)) // pd.Timedelta(seconds=1)
    if drop: df.drop(field_name, axis=1, inplace=True)
    return df


# --- spacy 3: spacy.blank() no longer takes disable= ------------------------------------------------
# fastai's default text tokenizer fails with "blank() got an unexpected keyword argument 'disable'";
# a blank pipeline has no parser/tagger/ner to disable anyway.
def _fix_spacy_tokenizer(transform) -> None:
    transform.SpacyTokenizer.__init__ = _spacy_tokenizer_init


def _spacy_tokenizer_init(self, lang):
    import spacy  # imported by fastai.text already
    self.tok = spacy.blank(lang)


# --- numpy >= 1.24 / 2 --------------------------------------------------------------------------------
# numpy removed the aliases np.int/np.float/np.object that fastai still uses (LanguageModelPreLoader,
# OpenFileProcessor, MultiCategory labels, interpretation). numpy 2 has np.bool again: left alone.
def _restore_numpy_aliases() -> None:
    for name, builtin in (("int", int), ("float", float), ("object", object)):
        if name not in np.__dict__:
            setattr(np, name, builtin)


# np.array(ragged list) now raises "inhomogeneous shape" instead of building an object array; fastai's
# `array` relies on the old behaviour when numericalizing texts of different lengths.
_fastai_array = fastai.core.array


def _array(a, dtype=None, **kwargs):
    "Same as `np.array` but also handles generators and ragged sequences (as a 1-d object array)."
    if not isinstance(a, Sized) and not getattr(a, "__array_interface__", False):
        a = list(a)  # once, here: a generator (MultiCategoryList's csv.reader) is empty at the second attempt
    try:
        return _fastai_array(a, dtype=dtype, **kwargs)
    except ValueError:
        if dtype not in (None, object):
            raise
        items = list(a)
        res = np.empty(len(items), dtype=object)
        for i, o in enumerate(items):
            res[i] = o
        return res


# SortishSampler (text classifier training) permutes a ragged list of index chunks with
# np.random.permutation, which now raises; permute the chunk positions instead. Same bucketing.
def sortish_chunks(sampler):
    """SortishSampler's batches: random bs*50 blocks sorted by decreasing key, cut in batches of bs.

    Returns the batch holding the longest item (fastai puts it first) and the others, in order."""
    idxs = np.random.permutation(len(sampler.data_source))
    sz = sampler.bs * 50
    sort_idx = np.concatenate([sorted(idxs[i:i+sz], key=sampler.key, reverse=True) for i in range(0, len(idxs), sz)])
    chunks = [sort_idx[i:i+sampler.bs] for i in range(0, len(sort_idx), sampler.bs)]
    first = int(np.argmax([sampler.key(ck[0]) for ck in chunks]))
    return chunks[first], chunks[:first] + chunks[first+1:]


def _fix_sortish_sampler(data) -> None:
    data.SortishSampler.__iter__ = _sortish_iter


def _sortish_iter(self):
    first, rest = sortish_chunks(self)
    rest = [rest[i] for i in np.random.permutation(len(rest))]
    return iter(np.concatenate([first, *rest]).astype(np.int64))


# --- torch 2: autograd refuses in-place ops on the views `chunk` returns -------------------------------
# QRNNLayer.forward (AWD_LSTM(qrnn=True)) calls tanh_()/sigmoid_() on chunks of one matmul's output: every
# forward pass raises "Output 0 of SplitBackward0 is a view and is being modified inplace". fastai imports
# its qrnn module only for a QRNN (it compiles CUDA kernels where CUDA is present), so it is patched when
# imported.
def _inplace_on_a_chunk_fails() -> bool:
    y = torch.zeros(1, 2, requires_grad=True) * 1
    try:
        y.chunk(2, dim=1)[0].tanh_()
    except RuntimeError:
        return True
    return False


def _fix_qrnn(qrnn) -> None:
    from fastai.text.models.awd_lstm import dropout_mask  # fastai.text is imported by then
    _rebody(qrnn.QRNNLayer.forward, _qrnn_layer_forward)
    qrnn.dropout_mask = dropout_mask  # fastai's qrnn never imported it: QRNN(zoneout=...) raised NameError


# QRNNLayer.forward with tanh()/sigmoid() out of place. It runs with fastai.text.models.qrnn's globals (see
# _rebody): the forget-mult functions below are that module's.
def _qrnn_layer_forward(self, inp, hid=None):
    y = self.linear(self._get_source(inp))
    if self.output_gate: z_gate, f_gate, o_gate = y.chunk(3, dim=2)
    else: z_gate, f_gate = y.chunk(2, dim=2)
    z_gate, f_gate = z_gate.tanh(), f_gate.sigmoid()
    if self.zoneout and self.training:
        mask = dropout_mask(f_gate, f_gate.size(), self.zoneout).requires_grad_(False)  # noqa: F821
        f_gate = f_gate * mask
    z_gate, f_gate = z_gate.contiguous(), f_gate.contiguous()
    if self.backward:
        forget_mult = dispatch_cuda(BwdForgetMultGPU, partial(forget_mult_CPU, backward=True), inp)  # noqa: F821
    else:
        forget_mult = dispatch_cuda(ForgetMultGPU, forget_mult_CPU, inp)  # noqa: F821
    c_gate = forget_mult(z_gate, f_gate, hid, self.batch_first)
    output = torch.sigmoid(o_gate) * c_gate if self.output_gate else c_gate
    if self.window > 1 and self.save_prev_x:
        if self.backward: self.prevX = (inp[:, :1] if self.batch_first else inp[:1]).detach()
        else: self.prevX = (inp[:, -1:] if self.batch_first else inp[-1:]).detach()
    idx = 0 if self.backward else -1
    return output, (c_gate[:, idx] if self.batch_first else c_gate[idx])


# --- IPython 9 removed IPython.core.display.display ---------------------------------------------------------
# fastai.gen_doc imports it from there, so `doc()` and `show_doc` (course notebooks) and fastai's own test
# conftest fail to import. It lives in IPython.core.display_functions since IPython 7.23.
def _restore_ipython_display() -> None:
    try:
        import IPython.core.display as display_module
        from IPython.core.display_functions import display
    except ImportError:
        return
    if not hasattr(display_module, "display"):
        display_module.display = display


# --- fastprogress 1.0.5 console: a results row after an epoch cut short is appended to its bar's line ------
# An epoch stopped early (StopAfterNBatches, a callback's stop_epoch) leaves its bar unfinished, so the bar is
# never cleared and fastai's results row follows it on the same line. Clear it first, as a finished bar is.
def _row_follows_a_cut_bar() -> bool:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        master = ConsoleMasterBar(range(1))
        for _ in master:
            for _ in ConsoleProgressBar(range(2), parent=master):
                break
            master.write("row")
    return re.search(r"[\r\n]row", out.getvalue()) is None


_console_write = ConsoleMasterBar.write


def _write_on_a_fresh_line(self, line, table=False):
    "`ConsoleMasterBar.write`, first clearing the line of the current bar if its epoch was cut short."
    child = getattr(self, "child", None)
    if child is not None and child.last_v is not None:
        child.on_iter_end()
        child.last_v = None
    _console_write(self, line, table)


# --- torch 2: a loader that asks for pinned memory warns where there is no accelerator ---------------------
# fastai replaces DataLoader.__init__ with its own, whose pin_memory defaults to True (torch's is False), so every
# loader (fastai's, and the user's own) printed "'pin_memory' argument is set as true but no accelerator is found"
# at every epoch on a machine without GPU, where pinning does nothing. Default to False there.
def _pinning_warns() -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iter(torch.utils.data.DataLoader([0], pin_memory=True))
    return any("'pin_memory' argument is set as true" in str(w.message) for w in caught)


def _no_pinning_by_default(init) -> None:
    """Make the default of `init`'s pin_memory argument False (a loader asked for it explicitly still pins)."""
    names = list(inspect.signature(init).parameters)
    defaults = list(init.__defaults__)
    defaults[names.index("pin_memory") - (len(names) - len(defaults))] = False
    init.__defaults__ = tuple(defaults)


# --- torchvision >= 0.13 deprecated `pretrained` for `weights` --------------------------------------------------
# fastai's create_body (cnn_learner, unet_learner) calls `arch(pretrained)`, the old interface, so every cnn_learner on
# a torchvision model printed two deprecations of a call the user did not write. They are ignored during that call
# alone, by message and module: the user's own calls of torchvision's builders still warn.
def _fix_create_body(learner) -> None:
    _rebody(learner.create_body, _create_body)


# It runs with fastai.vision.learner's globals (see _rebody): cnn_config and has_pool_type are that module's.
def _create_body(arch, pretrained=True, cut=None):
    "Cut off the body of a typically pretrained `model` at `cut` (int) or as specified by `cut(model)` (function)."
    with warnings.catch_warnings():
        for message in ("Using 'weights' as positional parameter", "Arguments other than a weight enum or `None`"):
            warnings.filterwarnings("ignore", message, UserWarning, r"torchvision\.models\._utils")
        model = arch(pretrained)
    cut = ifnone(cut, cnn_config(arch)["cut"])  # noqa: F821
    if cut is None:
        ll = list(enumerate(model.children()))
        cut = next(i for i, o in reversed(ll) if has_pool_type(o))  # noqa: F821
    if isinstance(cut, int): return nn.Sequential(*list(model.children())[:cut])
    elif isinstance(cut, Callable): return cut(model)
    else: raise NamedError("cut must be either integer or a function")  # noqa: F821  (fastai's: a NameError)


# --- torch 2: optimizer.zero_grad() sets the gradients to None (set_to_none=True) ------------------------------
# AccumulateScheduler's epoch end divides every gradient by the samples accumulated since the last step, then steps:
# when the epoch's batch count is a multiple of n_step, the last step's zero_grad left None where torch 1 left zeros,
# and `p.grad.div_` raised AttributeError. Give those parameters the zeros torch 1 had: the same step follows.
def _zero_grad_sets_none() -> bool:
    """Read from zero_grad's signature: making an optimizer would import torch._dynamo (1.4 s) on `import ddipp`."""
    return inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default is True


def _accumulate_scheduler_on_epoch_end(self, **kwargs):
    "Step the rest of the accumulated grads if not perfectly divisible."
    for p in self.learn.model.parameters():
        if p.requires_grad:
            if p.grad is None: p.grad = torch.zeros_like(p)
            p.grad.div_(self.acc_samples)
    if not self.drop_last: self.learn.opt.step()
    self.learn.opt.zero_grad()
