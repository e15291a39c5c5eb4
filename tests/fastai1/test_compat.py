"""Each fastai 1.0.61 fix in ddipp.compat, exercised the way a course-v3 user hits it (single process)."""
import contextlib
import csv
import functools
import io
import os
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddipp  # noqa: F401  (applies the fixes)
import ddipp.fastai1.compat
import fastai.core
import fastai.text.data
from fastai.collab import CollabDataBunch, collab_learner
from fastai.tabular import (Categorify, FillMissing, Normalize, TabularList, add_datepart, tabular_learner)
from fastai.text import (AWD_LSTM, TextClasDataBunch, TextLMDataBunch, Tokenizer, awd_lstm_lm_config,
                         language_model_learner)
from fastai.vision import (ImageDataBunch, ImageList, Learner, accuracy, accuracy_thresh, cnn_learner, get_transforms,
                           load_learner, models, open_image, simple_cnn)
from fastai.basic_data import DataBunch, load_data
from fastai.callbacks.misc import StopAfterNBatches
from fastai.data_block import LabelLists
from fastai.train import AccumulateScheduler

from compare import assert_same_tensors


def _digits_learner(path, **kwargs):
    torch.manual_seed(0)
    data = ImageDataBunch.from_folder(path, size=32, bs=64, num_workers=0, **kwargs)
    return Learner(data, simple_cnn((3, 16, 32, 10)), metrics=accuracy)


def _params(learn):
    return [p.detach().clone() for p in learn.model.parameters()]


def test_every_fastai_application_imports():
    import fastai.collab, fastai.distributed, fastai.tabular, fastai.text, fastai.vision  # noqa: F401,E401
    from fastai.widgets import ImageCleaner  # noqa: F401  (lesson 2; needs ipywidgets)


def test_doc_and_show_doc_import():
    from fastai.gen_doc.nbdoc import doc, show_doc  # IPython 9 moved `display`; gen_doc imports it from the old place
    assert callable(doc) and callable(show_doc)


def test_apply_is_idempotent():
    ddipp.fastai1.compat.apply()
    ddipp.fastai1.compat._applied = False
    ddipp.fastai1.compat.apply()  # a second real application must not wrap the wrappers
    assert fastai.text.data.array is ddipp.fastai1.compat._array
    assert ddipp.fastai1.compat._fastai_array is not ddipp.fastai1.compat._array


def test_lr_find_reloads_its_weights_and_plots(digits_path, tmp_path):
    learn = _digits_learner(digits_path)
    learn.fit_one_cycle(1, 1e-2)  # leaves numpy scalars in the optimizer state that lr_find saves
    before = _params(learn)
    learn.lr_find(num_it=15)
    assert len(learn.recorder.lrs) > 5
    assert_same_tensors(before, _params(learn))
    png = tmp_path / "lr.png"
    learn.recorder.plot(return_fig=True).savefig(png)
    assert png.stat().st_size > 1000


def test_save_load_with_optimizer_after_one_cycle(digits_path):
    learn = _digits_learner(digits_path)
    learn.fit_one_cycle(1, 1e-2)
    saved = _params(learn)
    learn.save("stage-1")
    with torch.no_grad():
        for p in learn.model.parameters():
            p.zero_()
    learn.load("stage-1")
    assert_same_tensors(saved, _params(learn))
    assert isinstance(learn.opt.lr, (float, np.floating))


@pytest.mark.skipif(not ddipp.fastai1.compat._TORCH_LOADS_WEIGHTS_ONLY, reason="torch.load is weights-only by "
                                                                             "default from torch 2.6")
def test_torch_load_stays_weights_only(tmp_path):
    buf = io.BytesIO()
    torch.save({"f": functools.partial(print, 1)}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf)


def test_export_and_load_learner_predict_the_same(digits_path):
    learn = _digits_learner(digits_path)
    learn.fit(1, 1e-2)
    learn.export()
    loaded = load_learner(digits_path)
    img = open_image(next((digits_path / "valid" / "3").iterdir()))
    assert torch.allclose(learn.predict(img)[2], loaded.predict(img)[2], atol=1e-6)


def test_save_and_load_data(digits_path):
    data = ImageDataBunch.from_folder(digits_path, size=32, bs=64, num_workers=0)
    data.save("data.pkl")
    loaded = load_data(digits_path, "data.pkl", bs=64, num_workers=0)
    assert list(loaded.valid_ds.x.items) == list(data.valid_ds.x.items)


def test_load_empty_rebuilds_the_exported_data(digits_path, tmp_path):
    data = ImageDataBunch.from_folder(digits_path, size=32, bs=64, num_workers=0)
    data.export(tmp_path / "export.pkl")
    assert LabelLists.load_empty(tmp_path).train.y.classes == data.classes
    empty = ImageDataBunch.load_empty(tmp_path)
    assert empty.classes == data.classes and empty.train_ds.y.c == 10


def test_purge_keeps_the_model_and_the_optimizer(digits_path):
    learn = _digits_learner(digits_path)
    learn.fit(1, 1e-2)
    saved = _params(learn)
    learn.purge(clear_opt=False)
    assert_same_tensors(saved, _params(learn))
    assert learn.opt is not None and learn.recorder.losses
    learn.fit(1, 1e-3)


def _planet_style_df(digits_path):
    """Digit images tagged like the planet lesson: space-separated tags, one or two per image."""
    def tags(d):
        return " ".join(["even" if d % 2 == 0 else "odd"] + ["prime"] * (d in (2, 3, 5, 7)) + ["zero"] * (d == 0))
    rows = [(str(f.relative_to(digits_path)), tags(int(f.parent.name)))
            for f in sorted(digits_path.glob("*/*/*.png"))]
    return pd.DataFrame(rows, columns=["name", "tags"])


def test_multi_label_from_df_with_label_delim(digits_path):
    df = _planet_style_df(digits_path)
    data = (ImageList.from_df(df, digits_path, cols="name").split_by_rand_pct(0.2, seed=0)
            .label_from_df("tags", label_delim=" ").databunch(bs=64, num_workers=0))
    assert data.classes == ["even", "odd", "prime", "zero"]
    for i in (0, 1, 2, 500):
        assert sorted(data.train_ds.y[i].obj) == sorted(data.train_ds.inner_df.tags.iloc[i].split())
    assert {len(y.obj) for y in data.train_ds.y} == {1, 2}
    torch.manual_seed(0)
    learn = Learner(data, nn.Sequential(simple_cnn((3, 16, 32, 32)), nn.Linear(32, 4)), metrics=accuracy_thresh)
    learn.fit_one_cycle(5, 3e-2)
    assert float(learn.recorder.metrics[-1][0]) > 0.85  # 0.92; 0.62 predicts no tag at all


def test_array_reads_a_generator_of_ragged_rows_once():
    rows = ddipp.fastai1.compat._array(csv.reader(["a b", "c", "d e f"], delimiter=" "))
    assert [list(r) for r in rows] == [["a", "b"], ["c"], ["d", "e", "f"]]


def test_epoch_cut_short_prints_its_results_row_on_a_line_of_its_own(digits_path):
    learn = _digits_learner(digits_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        learn.fit(2, 1e-3, callbacks=[StopAfterNBatches(n_batches=2)])
    lines = re.sub(r"^.*\r", "", out.getvalue(), flags=re.M).splitlines()  # as a terminal shows it
    assert lines[0].split() == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    assert lines[1].split()[0] == "0" and len(lines) == 2


def test_default_transforms_warp_and_tta(digits_path):
    learn = _digits_learner(digits_path, ds_tfms=get_transforms(do_flip=False))  # max_warp=0.2 solves a system
    assert learn.data.one_batch()[0].shape == (64, 3, 32, 32)
    preds, targets = learn.TTA()
    assert preds.shape == (360, 10)


def _tabular_df(n=400, seed=0):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"a": rng.choice(["x", "y", "z"], n), "b": rng.choice(["u", "v"], n),
                       "c1": rng.normal(size=n), "c2": rng.normal(size=n)})
    df.loc[rng.random(n) < 0.1, "c1"] = np.nan
    df["y"] = (df.c2 + 1.5 * (df.a == "x") > 0.5).astype(int)
    return df


def test_tabular_categorify_and_training(tmp_path):
    df = _tabular_df()
    data = (TabularList.from_df(df, path=tmp_path, cat_names=["a", "b"], cont_names=["c1", "c2"],
                                procs=[FillMissing, Categorify, Normalize])
            .split_by_idx(list(range(300, 400))).label_from_df("y").databunch(bs=32, num_workers=0))
    assert list(data.train_ds.inner_df["a"].cat.categories) == ["x", "y", "z"]
    learn = tabular_learner(data, layers=[32], metrics=accuracy)
    learn.fit_one_cycle(3, 1e-2)
    assert float(learn.recorder.metrics[-1][0]) > 0.8


def test_add_datepart_matches_the_calendar():
    df = add_datepart(pd.DataFrame({"Date": ["2015-07-31", "2015-01-01"]}), "Date")
    assert list(df.Week) == [31, 1] and list(df.Dayofweek) == [4, 3] and list(df.Is_month_end) == [True, False]
    assert list(df.Elapsed) == [1438300800, 1420070400]


def test_collab_databunch_and_training(tmp_path):
    rng = np.random.default_rng(0)
    users, items = rng.integers(0, 30, 1500), rng.integers(0, 20, 1500)
    ratings = pd.DataFrame({"user": users, "item": items, "rating": (users % 5 + items % 3).astype(float)})
    data = CollabDataBunch.from_df(ratings, seed=0, valid_pct=0.2, bs=64, path=tmp_path, num_workers=0)
    learn = collab_learner(data, n_factors=8, y_range=(0, 7))
    learn.fit_one_cycle(2, 5e-2)
    assert learn.recorder.val_losses[-1] < learn.recorder.val_losses[0]


def _texts(n=300, seed=0):
    rng = np.random.default_rng(seed)
    good, bad = ["great", "good", "lovely", "fine"], ["awful", "bad", "boring", "poor"]
    rows = []
    for i in range(n):
        label = i % 2
        words = list(rng.choice(good if label else bad, rng.integers(3, 15))) + ["movie", "!"]
        rows.append(("It was a " + " ".join(words) + " isn't it?", label))
    return pd.DataFrame(rows, columns=["text", "label"])


def test_spacy_tokenizer():
    tokens = Tokenizer().process_all(["Hello world! It isn't."])[0]
    assert tokens == ["xxmaj", "hello", "world", "!", "xxmaj", "it", "is", "n't", "."]


def test_text_language_model_and_sortish_classifier_loader(tmp_path):
    df = _texts()
    train, valid = df[:250], df[250:]  # 250 is not a multiple of bs: ragged chunks
    data_lm = TextLMDataBunch.from_df(tmp_path, train, valid, text_cols="text", bs=16, bptt=10, num_workers=0)
    small = {**awd_lstm_lm_config, "emb_sz": 16, "n_hid": 32}  # the default 24M parameters: 30 s an epoch here
    learn = language_model_learner(data_lm, AWD_LSTM, config=small, pretrained=False, drop_mult=0.1)
    learn.fit(1, 1e-2)
    data_clas = TextClasDataBunch.from_df(tmp_path, train, valid, text_cols="text", label_cols="label",
                                          vocab=data_lm.vocab, bs=16, num_workers=0)
    sampler = data_clas.train_dl.dl.batch_sampler.sampler
    assert isinstance(sampler, fastai.text.data.SortishSampler)
    order = list(sampler)
    assert sorted(order) == list(range(len(data_clas.train_ds)))
    lengths = [len(data_clas.train_ds.x.items[i]) for i in order[:16]]
    assert lengths[0] == max(len(t) for t in data_clas.train_ds.x.items)  # longest batch first, as in fastai


def test_qrnn_forward_and_backward():
    from fastai.text.models.qrnn import QRNN
    torch.manual_seed(0)
    model = AWD_LSTM(vocab_sz=50, emb_sz=8, n_hid=16, n_layers=2, pad_token=1, qrnn=True)
    out, _ = model(torch.randint(0, 50, (4, 7)))
    out[-1].sum().backward()
    assert out[-1].shape == (4, 7, 8) and model.encoder.weight.grad is not None
    qrnn = QRNN(8, 16, zoneout=0.5).train()  # zoneout: fastai's qrnn module never imported dropout_mask
    assert qrnn(torch.randn(2, 5, 8))[0].shape == (2, 5, 16)


def test_a_module_is_patched_when_imported(tmp_path, monkeypatch):
    (tmp_path / "ddipp_probe.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ddipp.fastai1.compat._when_imported("ddipp_probe", lambda module: setattr(module, "value", 2))
    try:
        import ddipp_probe
        assert ddipp_probe.value == 2
    finally:
        sys.modules.pop("ddipp_probe", None)


def _tensor_data(n=64, bs=8):
    x = torch.randn(n, 4)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    return DataBunch.create(data, data, bs=bs, num_workers=0)


APPLICATIONS = ("spacy", "fastai.text", "fastai.vision", "fastai.tabular", "fastai.collab")


@pytest.mark.slow
def test_ddipp_imports_no_fastai_application_fixes_one_imported_after_it_and_shows_only_the_users_warning():
    """A plain or tabular script pays for no spacy, text or vision models (2-3 s of a core a process, each worker of
    a notebook's group too); an application imported after ddipp gets its fixes (spacy 3's tokenizer here)."""
    code = ("import sys, ddipp, ddipp.fastai1.notebook.fitting\n"
            f"print(sorted(m for m in sys.modules if m.startswith({APPLICATIONS!r})))\n"
            "from fastai.vision import *\n"
            "from fastai.text import Tokenizer\n"
            "print(Tokenizer().process_all(['Hello world'])[0])\n"
            "import warnings; warnings.warn('mine')")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # setuptools' pkg_resources deprecation was the other warning
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "<string>:6: UserWarning: mine\n", proc.stderr
    assert proc.stdout.splitlines() == ["[]", "['xxmaj', 'hello', 'world']"], proc.stdout


def _pinning_warnings(loader):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(loader))
    return [w for w in caught if "'pin_memory' argument is set as true" in str(w.message)]


# torch warns that pinned memory serves nothing where there is no accelerator (torch 2.4 did not warn)
TORCH_WARNS_OF_PINNING = bool(_pinning_warnings(DataLoader(TensorDataset(torch.zeros(2)), pin_memory=True)))


@pytest.mark.skipif(not TORCH_WARNS_OF_PINNING, reason="torch does not warn of pinned memory here: an accelerator "
                                                        "uses it, or torch is older than the warning")
def test_loaders_do_not_ask_for_pinned_memory_without_an_accelerator():
    data = _tensor_data()
    assert not data.train_dl.pin_memory and not data.train_dl.new(shuffle=False).pin_memory
    assert not _pinning_warnings(data.train_dl) and not _pinning_warnings(DataLoader(data.train_ds))
    assert _pinning_warnings(DataLoader(data.train_ds, pin_memory=True))  # asked for: torch still says it is useless


def test_cnn_learner_is_quiet_and_torchvisions_own_deprecations_still_show(digits_path):
    data = ImageDataBunch.from_folder(digits_path, size=16, bs=64, num_workers=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cnn_learner(data, models.resnet18, pretrained=False)  # fastai calls resnet18(False), torchvision's old API
    assert not [str(w.message) for w in caught if "deprecated since 0.13" in str(w.message)]
    with pytest.warns(UserWarning, match="deprecated since 0.13"):
        models.resnet18(False)  # the user's own old-style call


def _accumulated_fit():
    """Two epochs of 8 batches with AccumulateScheduler(n_step=4): each epoch ends on an accumulated step."""
    torch.manual_seed(0)
    data = _tensor_data()
    learn = Learner(data, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(reduction="sum"))
    learn.fit(2, 1e-2, callbacks=[AccumulateScheduler(learn, n_step=4)])
    return _params(learn)


def test_accumulate_scheduler_ends_an_epoch_on_a_step_as_on_torch_1(monkeypatch):
    on_torch_2 = _accumulated_fit()  # fastai's on_epoch_end divided the None gradients torch 2's zero_grad leaves
    zero_grad = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda opt, set_to_none=False: zero_grad(opt, set_to_none))
    assert_same_tensors(on_torch_2, _accumulated_fit())  # torch 1's zero_grad: zeros
