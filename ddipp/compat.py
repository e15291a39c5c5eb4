"""The smallest fixes that make fastai 1.0.61 run on torch 2.14 / numpy 2 / pandas 3 / spacy 3.

Each fix checks that the old behaviour is really gone before it changes anything, says what breaks
and why, and is applied once by `apply()` (called on `import ddipp`). The README lists them.
"""
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import spacy
import torch

import fastai.basic_data
import fastai.basic_train
import fastai.core
import fastai.tabular.transform
import fastai.text.data
import fastai.text.transform
import fastai.train  # noqa: F401  (adds fit_one_cycle, lr_find, to_fp16 to Learner)
import fastai.vision.transform
from fastai.basic_data import data_collate, distrib_barrier, is_pathlike
from fastai.basic_train import LabelLists, load_callback
from fastai.core import defaults, ifnone

_TORCH_LOADS_WEIGHTS_ONLY = torch.__version__ >= (2, 6)   # torch.load(weights_only=True) became the default
_NUMPY_REJECTS_RAGGED = np.lib.NumpyVersion(np.__version__) >= "1.24.0"
_PANDAS_2 = int(pd.__version__.split(".")[0]) >= 2
_SPACY_3 = int(spacy.__version__.split(".")[0]) >= 3

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
    if _torch_solve_removed():
        fastai.vision.transform._solve_func = _solve
    if _PANDAS_2:
        fastai.tabular.transform.Categorify.apply_train = _categorify_apply_train
        fastai.tabular.transform.Categorify.apply_test = _categorify_apply_test
        _rebody(fastai.tabular.transform.make_date, _make_date)
        _rebody(fastai.tabular.transform.add_datepart, _add_datepart)
    if _SPACY_3:
        fastai.text.transform.SpacyTokenizer.__init__ = _spacy_tokenizer_init
    _restore_numpy_aliases()
    if _NUMPY_REJECTS_RAGGED:
        _replace_in_fastai_modules(fastai.core.array, _array)
        fastai.text.data.SortishSampler.__iter__ = _sortish_iter


def _rebody(old, new) -> None:
    """Give function `old` the code of `new`, so references taken before `import ddipp` get the fix too.

    `new` runs with `old`'s module globals: it may only use names that module defines (compat imports
    the same names, so `new` reads as ordinary code here)."""
    old.__code__ = new.__code__


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
def _spacy_tokenizer_init(self, lang):
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


def _sortish_iter(self):
    first, rest = sortish_chunks(self)
    rest = [rest[i] for i in np.random.permutation(len(rest))]
    return iter(np.concatenate([first, *rest]).astype(np.int64))
