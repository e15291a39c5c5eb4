"""The fastai v2 applications on small offline tasks, played alike by tests/fastai2/test_apps.py in one process with the
global batch (the reference) and on a notebook's group of 2 workers (to_ddp(nprocs=2)), and by apps_worker.py on 2
launched ranks: `play` trains them in turn and returns, per application, what the tests compare."""
import io
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from fastai.callback.core import Callback
from fastai.callback.schedule import fine_tune, fit_one_cycle  # noqa: F401 (add the Learner methods)
from fastai.collab import CollabDataLoaders, collab_learner
from fastai.data.block import CategoryBlock, DataBlock
from fastai.data.transforms import ColReader, ColSplitter
from fastai.metrics import Perplexity, accuracy, mae
from fastai.tabular.all import Categorify, FillMissing, Normalize, TabularPandas, tabular_learner
from fastai.text.all import (AWD_LSTM, BaseTokenizer, TextBlock, Tokenizer, language_model_learner,
                             text_classifier_learner)
from fastai.torch_core import set_seed
from fastai.vision.all import ImageDataLoaders, vision_learner, xresnet18

from ddipp.fastai2.loaders import ShardedTrainDL
from stories import ratings, tabular_frame, topic_docs

# a rank reads GLOBAL_BS // world a step
GLOBAL_BS = dict(lm=32, clas=32, vision=64, tabular=128, tabular_cat=64, collab=128)
AWD = dict(emb_sz=32, n_hid=64, n_layers=2, pad_token=1, bidir=False, output_p=0.1, hidden_p=0.1, input_p=0.1,
           embed_p=0.02, weight_p=0.1)


def play(out: Path, world: int, digits: Path, **ddp) -> dict:
    """Every application in turn, with batch GLOBAL_BS // `world` a process, each learner bound by to_ddp(**ddp)."""
    runs = dict(lm=language_model, clas=classifier, vision=lambda path, bs, ddp: vision(path, bs, ddp, digits),
                tabular=tabular, tabular_cat=tabular_cat, collab=collab)
    res = {}
    for name, run in runs.items():
        set_seed(0)  # python's, numpy's and torch's generators: fastai shuffles text with the global ones
        start = time.perf_counter()
        res[name] = run(out / ("text" if name in ("lm", "clas") else name), GLOBAL_BS[name] // world, ddp)
        res[name]["seconds"] = time.perf_counter() - start
    return res


def final(learn) -> list:
    """The last epoch's validation loss and metrics, as floats."""
    return [float(v) for v in learn.recorder.values[-1][1:]]


def summary(learn) -> dict:
    """The recorder's epochs and the last validation, then validate() outside a fit (one process's, same weights)."""
    values = [[float(v) for v in row] for row in learn.recorder.values]
    return dict(final=final(learn), values=values, validated=[float(v) for v in learn.validate()])


# --- text: documents of one topic each; a topic is a cycle through the shared words, each step kept with p=keep


def _split(train: pd.DataFrame, valid: pd.DataFrame) -> pd.DataFrame:
    return pd.concat([train.assign(is_valid=False), valid.assign(is_valid=True)], ignore_index=True)


def _text_block(**kwargs) -> TextBlock:
    """fastai's TextBlock with a space tokenizer in this process (no spaCy, no tokenizing workers)."""
    return TextBlock(Tokenizer.from_df("text", tok=BaseTokenizer(), n_workers=0), **kwargs)


def lm_dls(path, bs: int, bptt: int = 10):
    """Language-model loaders: 200 documents train, 60 validate in 32 streams whatever `bs` (alike in every mode)."""
    block = DataBlock(blocks=_text_block(is_lm=True, seq_len=bptt), get_x=ColReader("text"), splitter=ColSplitter())
    docs = _split(topic_docs(200, 1, (20, 100)), topic_docs(60, 2, (20, 100)))
    return block.dataloaders(docs, bs=bs, val_bs=32, num_workers=0, path=path, device="cpu")


def clas_dls(path, bs: int, vocab):
    """Classifier loaders (fastai's SortedDL, padded by Pad_Chunk): 320 documents train, 100 validate in batches of
    32, of 8 to 160 words (up to 3 of the chunks of 72 the classifier reads)."""
    block = DataBlock(blocks=(_text_block(vocab=vocab), CategoryBlock), get_x=ColReader("text"),
                      get_y=ColReader("label"), splitter=ColSplitter())
    docs = _split(topic_docs(320, 3, (8, 160), 0.6), topic_docs(100, 4, (8, 160), 0.6))
    return block.dataloaders(docs, bs=bs, val_bs=32, num_workers=0, path=path, device="cpu")


def _train_source(dl):
    """The loader whose order a training loader reads: under ddipp the one its shard reads through."""
    return dl.dl if isinstance(dl, ShardedTrainDL) else dl


class LMStreamLog(Callback):
    """Records, each epoch, the document order and every training batch's input rows (after ddipp sharded them)."""
    order = 1  # after DistributedCallback sharded the loader

    def before_fit(self):
        self.orders, self.inputs = [], []

    def before_batch(self):
        if not self.training:
            return
        if self.iter == 0:  # the loader drew this epoch's order when it started
            self.orders.append([int(i) for i in _train_source(self.learn.dl).items.idxs])
            self.inputs.append([])
        self.inputs[-1].append(self.xb[0].tolist())


def lm_learner(path, bs: int):
    set_seed(0)
    return language_model_learner(lm_dls(path, bs), AWD_LSTM, config=dict(AWD, tie_weights=True, out_bias=True),
                                  pretrained=False, metrics=[accuracy, Perplexity()])


def language_model(path, bs: int, ddp: dict) -> dict:
    """Trains the language model from scratch and saves its encoder for the classifier (rank 0 writes)."""
    learn = lm_learner(path, bs).to_ddp(**ddp)
    log = LMStreamLog()
    learn.add_cb(log)
    learn.fit_one_cycle(3, 3e-2)
    learn.save_encoder("lm_enc")
    logged = dict(orders=log.orders, inputs=log.inputs)  # before validate(), which starts with before_fit too
    return dict(logged, **summary(learn))


class PaddingLog(Callback):
    """Records each epoch's training order, each training batch's width, the share of padding tokens, and the
    probabilities of the last validation (whole batches, after ddipp gathered them)."""
    order = 1  # after DistributedCallback and RNNCallback (which leaves the logits in learn.pred)

    def before_fit(self):
        self.orders, self.widths, self.pads, self.tokens, self.probs = [], [], 0, 0, []

    def before_train(self):
        if isinstance(self.learn.dl, ShardedTrainDL):  # a plain SortedDL would draw (and spend) a new order
            self.orders.append([int(i) for i in self.learn.dl.get_idxs()])

    def before_validate(self):
        self.probs = []

    def before_batch(self):
        if self.training:
            x = self.xb[0]
            self.widths.append(x.shape[1])
            self.pads, self.tokens = self.pads + int((x == 1).sum()), self.tokens + x.numel()

    def after_pred(self):
        if not self.training:
            self.probs.append(self.learn.pred.detach().float().softmax(-1))


def clas_learner(path, bs: int):
    set_seed(0)
    dls = clas_dls(path, bs, lm_dls(path, bs).vocab)
    return text_classifier_learner(dls, AWD_LSTM, config=dict(AWD, output_p=0.2), pretrained=False, drop_mult=0.5,
                                   metrics=accuracy)


def classifier(path, bs: int, ddp: dict) -> dict:
    """Fine-tunes the classifier from the language model's encoder (load_encoder) with gradual unfreezing."""
    learn = clas_learner(path, bs).to_ddp(**ddp)
    learn.load_encoder("lm_enc")  # and freezes all but the head
    log = PaddingLog()
    learn.add_cb(log)
    embedding = learn.model[0].module.encoder.weight  # the tensor the fits update, here or on the ranks
    loaded = embedding.detach().clone()
    learn.fit_one_cycle(1, 1e-1)
    learn.freeze_to(-2)
    learn.fit_one_cycle(1, slice(3e-2 / 2.6 ** 4, 3e-2))
    moved_while_frozen = float((embedding.detach() - loaded).abs().max())
    learn.unfreeze()
    learn.fit_one_cycle(2, slice(1e-2 / 2.6 ** 4, 1e-2))
    logged = dict(orders=log.orders, widths=log.widths, padding=log.pads / log.tokens)  # before validate()
    in_fit = torch.cat(log.probs)
    res = summary(learn)
    probs = learn.get_preds(reorder=False)[0]  # in the loader's order, as the fit saw them
    return dict(res, **logged, preds_gap=float((in_fit - probs).abs().max()), n_preds=len(in_fit),
                moved_while_frozen=moved_while_frozen, moved=float((embedding.detach() - loaded).abs().max()))


# --- vision, tabular, collab


def xresnet18_narrow(pretrained: bool = False):
    """fastai's xresnet18 with a quarter of its channels (16 to 128): 0.9M parameters, 75 ms a step of 64 on a CPU."""
    return xresnet18(pretrained=False, widen=0.25)


def vision(path, bs: int, ddp: dict, digits: Path) -> dict:
    """vision_learner(xresnet18_narrow, pretrained=False) + fine_tune on scikit-learn's digits as 16 px images."""
    dls = ImageDataLoaders.from_folder(digits, valid="valid", bs=bs, val_bs=64, num_workers=0, device="cpu")
    set_seed(0)
    learn = vision_learner(dls, xresnet18_narrow, pretrained=False, metrics=accuracy, path=path).to_ddp(**ddp)
    learn.fine_tune(2, 1e-2, lr_mult=1)  # lr_mult=1: the body is not pretrained
    return summary(learn)


def tabular(path, bs: int, ddp: dict) -> dict:
    """tabular_learner on TabularPandas with Categorify, FillMissing, Normalize; the last 600 rows validate."""
    df = tabular_frame()
    splits = (list(range(len(df) - 600)), list(range(len(df) - 600, len(df))))
    to = TabularPandas(df, procs=[Categorify, FillMissing, Normalize], cat_names=["shop", "day"],
                       cont_names=["x1", "x2", "x3"], y_names="label", y_block=CategoryBlock(), splits=splits)
    dls = to.dataloaders(bs=bs, val_bs=128, num_workers=0, path=path, device="cpu")
    set_seed(0)
    learn = tabular_learner(dls, layers=[64, 32], metrics=accuracy).to_ddp(**ddp)
    learn.fit_one_cycle(4, 3e-2)
    return summary(learn)


def tabular_cat(path, bs: int, ddp: dict) -> dict:
    """tabular_learner on the categorical columns alone: fastai's TabularModel keeps a BatchNorm1d(0), whose
    zero-element parameters never get a gradient."""
    df = tabular_frame()
    splits = (list(range(len(df) - 600)), list(range(len(df) - 600, len(df))))
    to = TabularPandas(df, procs=[Categorify], cat_names=["shop", "day"], cont_names=[], y_names="label",
                       y_block=CategoryBlock(), splits=splits)
    dls = to.dataloaders(bs=bs, val_bs=128, num_workers=0, path=path, device="cpu")
    set_seed(0)
    learn = tabular_learner(dls, layers=[16], metrics=accuracy).to_ddp(**ddp)
    learn.fit_one_cycle(2, 1e-2)
    path.mkdir(parents=True, exist_ok=True)
    learn.export("export.pkl")
    return dict(summary(learn), saved_to_buffer=saved_to_buffer(learn), weights_sum=weights_sum(learn.model))


def weights_sum(model) -> float:
    """The sum of every weight of `model` (in float64): equal for the same weights."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def saved_to_buffer(learn) -> list:
    """`learn.save` to a buffer in this process: how many bytes it got, and whether they load back into its weights."""
    buffer = io.BytesIO()
    learn.save(buffer, with_opt=False)
    if not buffer.getvalue():
        return [0, False]
    state = torch.load(io.BytesIO(buffer.getvalue()))
    return [len(buffer.getvalue()), all(torch.equal(state[k], v) for k, v in learn.model.state_dict().items())]


def collab(path, bs: int, ddp: dict) -> dict:
    """collab_learner (dot product with biases, y_range) on latent-factor ratings; validation MSE (the loss), MAE."""
    dls = CollabDataLoaders.from_df(ratings(), valid_pct=0.15, seed=42, bs=bs, val_bs=256, path=path,
                                    num_workers=0, device="cpu")
    set_seed(0)
    learn = collab_learner(dls, n_factors=16, y_range=(0, 5.5), metrics=mae).to_ddp(**ddp)
    learn.fit_one_cycle(5, 3e-2, wd=0.05)
    return summary(learn)
