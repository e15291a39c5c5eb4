"""Each fastai 1.0.61 fix in ddipp.compat, exercised the way a course-v3 user hits it (single process)."""
import io
import pickle
import functools

import numpy as np
import pandas as pd
import pytest
import torch

import ddipp  # noqa: F401  (applies the fixes)
import ddipp.compat
import fastai.core
import fastai.text.data
from fastai.collab import CollabDataBunch, collab_learner
from fastai.tabular import (Categorify, FillMissing, Normalize, TabularList, add_datepart, tabular_learner)
from fastai.text import (AWD_LSTM, TextClasDataBunch, TextLMDataBunch, Tokenizer, language_model_learner)
from fastai.vision import (ImageDataBunch, Learner, accuracy, get_transforms, load_learner, open_image,
                           simple_cnn)
from fastai.basic_data import load_data


def _digits_learner(path, **kwargs):
    torch.manual_seed(0)
    data = ImageDataBunch.from_folder(path, size=32, bs=64, num_workers=0, **kwargs)
    return Learner(data, simple_cnn((3, 16, 32, 10)), metrics=accuracy)


def _params(learn):
    return [p.detach().clone() for p in learn.model.parameters()]


def test_every_fastai_application_imports():
    import fastai.collab, fastai.distributed, fastai.tabular, fastai.text, fastai.vision  # noqa: F401,E401


def test_apply_is_idempotent():
    ddipp.compat.apply()
    ddipp.compat._applied = False
    ddipp.compat.apply()  # a second real application must not wrap the wrappers
    assert fastai.text.data.array is ddipp.compat._array
    assert ddipp.compat._fastai_array is not ddipp.compat._array


def test_lr_find_reloads_its_weights_and_plots(digits_path, tmp_path):
    learn = _digits_learner(digits_path)
    learn.fit_one_cycle(1, 1e-2)  # leaves numpy scalars in the optimizer state that lr_find saves
    before = _params(learn)
    learn.lr_find(num_it=15)
    assert len(learn.recorder.lrs) > 5
    assert all(torch.equal(a, b) for a, b in zip(before, _params(learn)))
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
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(learn)))
    assert isinstance(learn.opt.lr, (float, np.floating))


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
    learn = language_model_learner(data_lm, AWD_LSTM, pretrained=False, drop_mult=0.1)
    learn.fit(1, 1e-2)
    data_clas = TextClasDataBunch.from_df(tmp_path, train, valid, text_cols="text", label_cols="label",
                                          vocab=data_lm.vocab, bs=16, num_workers=0)
    sampler = data_clas.train_dl.dl.batch_sampler.sampler
    assert isinstance(sampler, fastai.text.data.SortishSampler)
    order = list(sampler)
    assert sorted(order) == list(range(len(data_clas.train_ds)))
    lengths = [len(data_clas.train_ds.x.items[i]) for i in order[:16]]
    assert lengths[0] == max(len(t) for t in data_clas.train_ds.x.items)  # longest batch first, as in fastai
