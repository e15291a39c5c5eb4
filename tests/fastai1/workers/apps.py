"""The five fastai applications on small offline tasks, run in one process by tests/test_apps.py (the reference,
global batch) and on 2 launched ranks by apps_worker.py (per-rank batch); each returns what the tests compare."""
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from fastai.basic_train import LearnerCallback
from fastai.callbacks import CSVLogger
from fastai.collab import CollabDataBunch, collab_learner
from fastai.layers import conv_layer, res_block
from fastai.metrics import Perplexity, accuracy, mean_absolute_error
from fastai.tabular import Categorify, FillMissing, Normalize, TabularDataBunch, tabular_learner
from fastai.text import AWD_LSTM, TextClasDataBunch, TextLMDataBunch, Tokenizer, language_model_learner
from fastai.text import text_classifier_learner
from fastai.vision import ImageDataBunch, cnn_learner, imagenet_stats
from torch import nn

import ddipp
from scenario import digits_data, digits_learner, history, params
from stories import ratings, tabular_frame, topic_docs

AWD = dict(emb_sz=32, n_hid=64, n_layers=2, pad_token=1, qrnn=False, bidir=False, output_p=0.1, hidden_p=0.1,
           input_p=0.1, embed_p=0.02, weight_p=0.1)


def _final(learn):
    """The last epoch's validation loss and metrics, as floats."""
    return [float(learn.recorder.val_losses[-1]), *map(float, learn.recorder.metrics[-1])]


def _saved(learn, name: str) -> str:
    """Save the weights (rank 0 writes) and return the file's path without its suffix."""
    learn.save(name, with_opt=False)
    return str(Path(learn.path) / learn.model_dir / name)


def _timed(fit):
    start = time.perf_counter()
    fit()
    return time.perf_counter() - start


# --- text: documents of one topic each; a topic is a cycle through the shared words, each step kept with p=keep


def lm_data(path, bs: int, bptt: int = 10):
    return TextLMDataBunch.from_df(path, topic_docs(500, 1), topic_docs(80, 2), tokenizer=Tokenizer(n_cpus=1),
                                   text_cols="text", bs=bs, bptt=bptt)


def clas_data(path, bs: int, vocab):
    return TextClasDataBunch.from_df(path, topic_docs(640, 3, (8, 160), 0.6), topic_docs(200, 4, (8, 160), 0.6),
                                     tokenizer=Tokenizer(n_cpus=1), vocab=vocab, text_cols="text",
                                     label_cols="label", bs=bs)


class ResetBeforeValidation(LearnerCallback):
    """Starts validation from a zero hidden state, so its numbers can be recomputed from the weights alone."""
    started = False  # get_preds() calls no on_epoch_begin

    def on_epoch_begin(self, **kwargs):
        self.started = False

    def on_batch_begin(self, train, **kwargs):
        if not train and not self.started:
            self.learn.model.reset()
            self.started = True


class LMStreamLog(LearnerCallback):
    """Records, each epoch, the document order and every training batch's input (after ddipp sharded them)."""
    _order = 1  # after DistributedCallback

    def on_train_begin(self, **kwargs):
        self.orders, self.inputs = [], []

    def on_batch_begin(self, last_input, train, num_batch, **kwargs):
        if not train:
            return
        if num_batch == 0:
            self.orders.append([int(i) for i in self.learn.data.train_dl.dl.dataset.idx.idx])
            self.inputs.append([])
        self.inputs[-1].append(last_input.tolist())


def lm_learner(path, bs: int):
    """A small AWD-LSTM language model, from scratch, with accuracy and perplexity."""
    torch.manual_seed(0)
    return language_model_learner(lm_data(path, bs), AWD_LSTM, config=dict(AWD, tie_weights=True, out_bias=True),
                                  pretrained=False, metrics=[accuracy, Perplexity()])


def language_model(path, bs: int) -> dict:
    """Trains the language model; saves its encoder for the classifier (rank 0 writes, the others wait)."""
    learn = lm_learner(path, bs).to_ddp()  # joins the launcher's group; a no-op in a plain process
    learn.callback_fns += [ResetBeforeValidation, LMStreamLog]
    seconds = _timed(lambda: learn.fit_one_cycle(4, 2e-2))
    if ddipp.is_rank0():  # fastai's save_encoder writes on every rank
        learn.save_encoder("lm_enc")
    ddipp.barrier()
    log = learn.lm_stream_log
    res = dict(final=_final(learn), history=history(learn), seconds=seconds, orders=log.orders, inputs=log.inputs,
               weights=_saved(learn, "lm"))
    # outside a fit, after reading the recorder (get_preds() replaces it); validate() first: fastai's get_preds()
    # leaves the validation streams where it stopped (validate() rewinds them at its epoch's end)
    return dict(res, validated=[float(v) for v in learn.validate()], predicted=lm_predictions(learn))


def lm_predictions(learn) -> list:
    """Accuracy and mean cross-entropy of `learn.get_preds()` on the validation set, from a zero hidden state."""
    learn.model.reset()
    probs, targets = learn.get_preds()
    picked = probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return [float((probs.argmax(-1) == targets).float().mean()), float(-picked.log().mean())]


class PaddingLog(LearnerCallback):
    """Records the training order each epoch of a fit and how many of its training batches' tokens are padding."""
    _order = 1

    def on_train_begin(self, **kwargs):
        self.orders, self.pads, self.tokens = [], 0, 0

    def on_epoch_begin(self, **kwargs):
        self.orders.append([int(i) for i in self.learn.data.train_dl.dl.batch_sampler.sampler])

    def on_batch_begin(self, last_input, train, **kwargs):
        if train:
            self.pads += int((last_input == 1).sum())
            self.tokens += last_input.numel()


def clas_learner(path, bs: int):
    """A small AWD-LSTM classifier with the language model's vocabulary."""
    data = clas_data(path, bs, lm_data(path, bs).vocab)
    torch.manual_seed(0)
    return text_classifier_learner(data, AWD_LSTM, config=dict(AWD, output_p=0.2), pretrained=False,
                                   drop_mult=0.5, metrics=accuracy)


def classifier(path, bs: int) -> dict:
    """Fine-tunes the classifier from the language model's encoder (load_encoder) with gradual unfreezing."""
    learn = clas_learner(path, bs).to_ddp()
    learn.load_encoder("lm_enc")
    learn.callback_fns.append(PaddingLog)
    embedding = learn.model[0].module.encoder.weight.detach()  # the tensor itself, whoever wraps the model
    frozen, moved = embedding.clone(), []

    def fit():
        learn.freeze_to(-1)
        learn.fit_one_cycle(2, 2e-2)
        learn.freeze_to(-2)
        learn.fit_one_cycle(1, slice(1e-2 / 2.6 ** 4, 1e-2))
        moved.append(float((embedding - frozen).abs().max()))  # the embedding is still frozen
        learn.unfreeze()
        learn.fit_one_cycle(2, slice(5e-3 / 2.6 ** 4, 5e-3))

    seconds = _timed(fit)
    log = learn.padding_log
    return dict(final=_final(learn), history=history(learn), seconds=seconds, orders=log.orders,
                padding=log.pads / log.tokens, embedding_moved_while_frozen=moved[0],
                embedding_moved=float((embedding - frozen).abs().max()), weights=_saved(learn, "clas"))


# --- vision, tabular, collab


def small_resnet(pretrained: bool = False) -> nn.Sequential:
    """A body for cnn_learner of fastai's conv layers (BatchNorm) and residual blocks, 16 to 64 channels: 0.2M
    parameters, where resnet18's 11.7M took 24 s an epoch of these digits on one CPU process (this: 2 s)."""
    return nn.Sequential(conv_layer(3, 16, stride=2), res_block(16), conv_layer(16, 32, stride=2), res_block(32),
                         conv_layer(32, 64, stride=2), res_block(64), nn.AdaptiveAvgPool2d(1))


def vision_learner(path, bs: int):
    """cnn_learner(small_resnet, pretrained=False) on the digits image folder at `path`, at 16 px."""
    data = ImageDataBunch.from_folder(path, size=16, bs=bs, num_workers=0).normalize(imagenet_stats)
    torch.manual_seed(0)
    return cnn_learner(data, small_resnet, pretrained=False, metrics=accuracy)


def vision(path, bs: int) -> dict:
    learn = vision_learner(path, bs).to_ddp()
    seconds = _timed(lambda: learn.fit_one_cycle(3, 1e-2))
    return dict(final=_final(learn), history=history(learn), seconds=seconds, weights=_saved(learn, "vision"))


def tabular_learner_(path, bs: int):
    """tabular_learner with FillMissing, Categorify, Normalize on categorical and continuous columns."""
    df = tabular_frame()
    data = TabularDataBunch.from_df(path, df, "label", valid_idx=list(range(len(df) - 601, len(df))),
                                    procs=[FillMissing, Categorify, Normalize], cat_names=["shop", "day"],
                                    cont_names=["x1", "x2", "x3"], bs=bs, num_workers=0)
    torch.manual_seed(0)
    return tabular_learner(data, layers=[64, 32], metrics=accuracy)


def tabular(path, bs: int) -> dict:
    learn = tabular_learner_(path, bs).to_ddp()
    seconds = _timed(lambda: learn.fit_one_cycle(4, 1e-2))
    return dict(final=_final(learn), history=history(learn), seconds=seconds, weights=_saved(learn, "tabular"))


def tabular_cat_learner(path, bs: int):
    """tabular_learner on the categorical columns alone: fastai's TabularModel keeps a BatchNorm1d(0), whose
    zero-element parameters never get a gradient."""
    df = tabular_frame()[["shop", "day", "label"]]
    data = TabularDataBunch.from_df(path, df, "label", valid_idx=list(range(len(df) - 601, len(df))),
                                    procs=[Categorify], cat_names=["shop", "day"], cont_names=[], bs=bs, num_workers=0)
    torch.manual_seed(0)
    return tabular_learner(data, layers=[16], metrics=accuracy)


def tabular_cat(path, bs: int) -> dict:
    learn = tabular_cat_learner(path, bs).to_ddp()  # the default options
    seconds = _timed(lambda: learn.fit_one_cycle(2, 1e-2))
    return dict(final=_final(learn), history=history(learn), seconds=seconds)


def collab_learner_(path, bs: int):
    """collab_learner (dot product with biases) on latent-factor ratings; validation MSE (the loss) and MAE."""
    data = CollabDataBunch.from_df(ratings(), valid_pct=0.15, seed=42, bs=bs, path=path, num_workers=0)
    torch.manual_seed(0)
    return collab_learner(data, n_factors=16, y_range=(0, 5.5), wd=0.05, metrics=mean_absolute_error)


def collab(path, bs: int) -> dict:
    learn = collab_learner_(path, bs).to_ddp()
    seconds = _timed(lambda: learn.fit_one_cycle(5, 3e-2))
    return dict(final=_final(learn), history=history(learn), seconds=seconds, weights=_saved(learn, "collab"))


# --- fastai features inside a fit: on the digits MLP (no dropout, no BN: 2 ranks must equal one process)


def features(path, bs: int) -> dict:
    """freeze/fit_one_cycle, unfreeze with slice(lr/100, lr), fit_fc, all logged by one CSVLogger."""
    learn = digits_learner(digits_data(path, bs=bs)).to_ddp()
    learn.callback_fns += [partial(CSVLogger, filename="history", append=True), CSVFileName]
    learn.freeze()
    learn.fit_one_cycle(1, 1e-2)
    learn.unfreeze()
    learn.fit_one_cycle(2, slice(1e-4, 1e-2))
    lrs = [float(lr) for lr in learn.opt.read_val("lr")]
    learn.fit_fc(2, 1e-2)
    return dict(history=history(learn), params=[p.tolist() for p in params(learn)], layer_lrs=lrs,
                csv=(Path(learn.path) / "history.csv").read_text() if ddipp.is_rank0() else None,
                csv_written_to=learn.csv_file_name.name)


class CSVFileName(LearnerCallback):
    """Records the file this process's CSVLogger writes to."""
    _order = 1  # after CSVLogger opened it

    def on_train_begin(self, **kwargs):
        self.name = self.learn.csv_logger.file.name


def mixup(path, bs: int) -> dict:
    """MixUpCallback (learn.mixup()) on the digits MLP: each rank mixes its own batch, so only quality compares."""
    learn = digits_learner(digits_data(path, bs=bs, shuffle=True)).to_ddp().mixup()
    learn.fit_one_cycle(4, 1e-2)
    return dict(final=_final(learn), history=history(learn))


RUNS = dict(lm=language_model, clas=classifier, vision=vision, tabular=tabular, tabular_cat=tabular_cat, collab=collab,
            features=features, mixup=mixup)
FOLDERS = dict(lm="text", clas="text")  # the classifier loads the language model's encoder
GLOBAL_BS = dict(lm=32, clas=32, vision=64, tabular=64, tabular_cat=64, collab=128, features=32, mixup=32)
