"""What of a fastai v1 learner both the notebook and its workers hold, so that it travels as references
(ddipp.core.group.wire)."""
from typing import Any, Dict, Hashable

from fastai.basic_data import DataBunch, DeviceDataLoader
from fastai.basic_train import Learner


def loaders(data: DataBunch) -> Dict[str, DeviceDataLoader]:
    """The data bunch's loaders by attribute name (train_dl, valid_dl, fix_dl, test_dl, ...)."""
    return {name: dl for name, dl in vars(data).items() if isinstance(dl, DeviceDataLoader)}


def data_objects(data: DataBunch) -> Dict[Hashable, Any]:
    """The data bunch and its loaders, by the names both sides use for them."""
    return {"data": data, **{("dl", name): dl for name, dl in loaders(data).items()}}


def learner_objects(learn: Learner) -> Dict[Hashable, Any]:
    """What both sides hold of a learner: itself, its data and loaders, the model's modules and parameters."""
    objects = {"learn": learn, "model": learn.model, **data_objects(learn.data)}
    objects.update({("module", i): m for i, m in enumerate(learn.model.modules())})
    objects.update({("param", i): p for i, p in enumerate(learn.model.parameters())})
    return objects

