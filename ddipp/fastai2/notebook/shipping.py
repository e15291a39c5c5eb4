"""What of a fastai v2 learner both the notebook and its workers hold, so that it travels as references
(ddipp.core.group.wire), and fastai's control-flow exceptions, sent as references to where they are importable."""
from typing import Any, Dict, Hashable, List

import fastai.callback.core
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastcore.foundation import L

from ...core.group.wire import importable_from

# made in fastcore.basics's name (mk_class): sent by value, they were other classes to the workers' `except`
importable_from("fastai.callback.core", [getattr(fastai.callback.core, name) for name in (
    "CancelBatchException", "CancelBackwardException", "CancelStepException", "CancelTrainException",
    "CancelValidException", "CancelEpochException", "CancelFitException")])


def data_objects(dls: DataLoaders) -> Dict[Hashable, Any]:
    """The DataLoaders and each of its loaders, by the names both sides use for them."""
    return {"data": dls, **{("dl", i): dl for i, dl in enumerate(dls.loaders)}}


def learner_objects(learn: Learner, callbacks: List[Callback]) -> Dict[Hashable, Any]:
    """What both sides hold of a learner and a fit: the learner, its data, the model's modules and parameters, its
    metrics, and the fit's `callbacks` (the learner's and the fit's own, in the order both sides list them)."""
    objects = {"learn": learn, "model": learn.model, **data_objects(learn.dls)}
    objects.update({("module", i): m for i, m in enumerate(learn.model.modules())})
    objects.update({("param", i): p for i, p in enumerate(learn.model.parameters())})
    objects.update({("metric", i): m for i, m in enumerate(learn.metrics)})
    objects.update({("cb", i): cb for i, cb in enumerate(callbacks)})
    return objects


def fit_callbacks(learn: Learner, cbs: Any) -> List[Callback]:
    """The callbacks a fit runs that exist before it: the learner's, then those given to `fit` (a class given to fit
    is made inside it, and ends with it)."""
    return list(learn.cbs) + [cb for cb in L(cbs) if isinstance(cb, Callback)]

