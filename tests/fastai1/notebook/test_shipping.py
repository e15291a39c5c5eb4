"""Pickling between the notebook and its workers: references, weak references, tensors, digests."""
import gc
import threading

import pytest
import torch
from torch import nn

from fastai.basic_train import LearnerCallback

from ddipp.fastai1.notebook.fitting import fit_call
from ddipp.core.group.wire import HeldTensors, digest, dumps, loads, pickled_data
from ddipp.fastai1.notebook.shipping import data_objects, learner_objects
from compare import assert_same_tensors
from scenario import digits_data, digits_learner


def test_a_learner_travels_without_its_binding_and_its_callbacks_point_at_the_copy(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=16))
    learn.fit(1, 1e-2)  # leaves learn.recorder, which holds its learner through a weak reference
    vars(learn).update(ddp="binding", fit="bound fit")
    copy = loads(dumps(learn, objects=data_objects(learn.data), learner=learn), data_objects(learn.data))
    assert "ddp" not in vars(copy) and "fit" not in vars(copy) and copy.data is learn.data
    assert copy.recorder.learn is copy and copy.model is not learn.model
    assert_same_tensors(copy.model.parameters(), learn.model.parameters())
    assert [p for g in copy.opt.opt.param_groups for p in g["params"]] == list(copy.model.parameters())


def test_shared_objects_travel_as_references_to_the_receivers_own(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=16))
    learn.fit(1, 1e-2)
    objects = learner_objects(learn)
    back = loads(dumps(dict(opt=learn.opt, first=learn.model[0]), objects=objects), objects)
    assert back["first"] is learn.model[0]
    assert [id(p) for g in back["opt"].opt.param_groups for p in g["params"]] == list(map(id, learn.model.parameters()))


def test_equal_data_pickles_to_an_equal_digest_with_its_arrays_out_of_band(tmp_path):
    first, second, changed = [], [], []
    blob = dumps(digits_data(tmp_path, bs=16), buffers=first)
    assert digest(blob, first) == digest(dumps(digits_data(tmp_path, bs=16), buffers=second), second)
    assert digest(blob, first) != digest(dumps(digits_data(tmp_path, bs=32), buffers=changed), changed)
    assert len(blob) < 10_000 and sum(b.raw().nbytes for b in first) > 400_000
    data = loads(blob, buffers=first)
    x, _ = data.train_ds.tensors
    x += 1  # the arrays rebuilt on received buffers are writable tensors


def test_a_dead_weak_reference_stays_dead():
    class Owner:
        pass
    owner = Owner()
    ref = __import__("weakref").ref(owner)
    del owner
    gc.collect()
    assert loads(dumps(ref))() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_and_parameters_land_on_the_receivers_device():
    layer = nn.Linear(2, 2).cuda()
    back = loads(dumps(dict(layer=layer, buf=torch.ones(2, device="cuda"))), device=torch.device("cpu"))
    assert back["layer"].weight.device.type == "cpu" and isinstance(back["layer"].weight, nn.Parameter)
    assert back["buf"].device.type == "cpu" and torch.equal(back["layer"].weight, layer.weight.cpu())


class Forwarding:
    """Forwards unknown attributes to its dataset, as fastai's LanguageModelPreLoader does."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getattr__(self, k):
        return getattr(self.dataset, k)


def test_an_object_forwarding_its_attributes_travels():
    # plain pickle recurses for ever here: it asks the half-built object for __setstate__
    back = loads(dumps(Forwarding([3, 1, 2])))
    assert type(back) is Forwarding and back.dataset == [3, 1, 2] and back.count(3) == 1


def test_classes_with_a_metaclass_forwarding_attributes_travel_as_classes():
    import enum
    from fastai.basic_data import DatasetType  # EnumMeta has a __getattr__ on Python 3.11
    assert loads(dumps([DatasetType, DatasetType.Valid, enum.Enum])) == [DatasetType, DatasetType.Valid, enum.Enum]


class HoldsALock(LearnerCallback):
    def __init__(self, learn):
        super().__init__(learn)
        self.lock = threading.Lock()


def test_an_unpicklable_attribute_is_named_by_its_path(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=16))
    learn.callbacks += [HoldsALock(learn)]
    learn.callbacks[0].lock = None  # an attribute of the same name elsewhere that does pickle
    learn.callbacks += [HoldsALock(learn)]
    with pytest.raises(TypeError) as raised:
        fit_call(learn, frozenset(), 1, 1e-2, None, [])
    assert str(raised.value) == ("ddipp sends the learner to its worker processes, and learn.holds_a_lock.lock cannot "
                                 "be pickled (cannot pickle '_thread.lock' object); set it to None or delete it "
                                 "before the fit, or make its class picklable")


def test_unpicklable_data_is_named_by_its_path(tmp_path):
    data = digits_data(tmp_path, bs=16)
    data.valid_dl.dl.dataset.lock = threading.Lock()
    with pytest.raises(TypeError) as raised:
        pickled_data(data, "learn.data")
    assert str(raised.value) == ("ddipp sends the learner's data to its worker processes, and "
                                 "learn.data.valid_dl.dl.dataset.lock cannot be pickled (cannot pickle '_thread.lock' "
                                 "object); set it to None or delete it before the fit, or make its class picklable")


def test_tensors_the_workers_hold_travel_as_digests_and_each_use_gets_a_tensor_of_its_own():
    torch.manual_seed(0)
    weight, ones, other, small = torch.randn(64, 32), torch.ones(512), torch.randn(300), torch.randn(8)
    message = dict(weight=weight, ones=ones, same_ones=torch.ones(512), other=other, small=small)
    kept_weight, kept_ones = weight.clone(), torch.ones(512)  # what a worker holds after its fit
    held = HeldTensors()
    digests = held.keep([kept_weight, kept_ones, torch.ones(2)])  # 8 bytes: travels whole, never held
    assert len(digests) == 2
    whole, named = dumps(message), dumps(message, held=frozenset(digests))
    assert len(whole) - len(named) >= (64 * 32 + 512 * 2) * 4 - 500  # the weight and both ones, less their digests
    got = loads(named, held=held)
    assert got["weight"].data_ptr() == kept_weight.data_ptr() and got["ones"].data_ptr() == kept_ones.data_ptr()
    assert got["same_ones"].data_ptr() != kept_ones.data_ptr()  # equal values: a copy, or a fit would train one tensor
    assert all(torch.equal(got[k], v) for k, v in message.items())
    assert held.tensors == {} and held.taken == {}  # what the message did not take is dropped; the fit changes the rest
    with pytest.raises(RuntimeError, match="holds no tensor"):  # a record that went wrong fails loudly
        loads(named, held=held)
