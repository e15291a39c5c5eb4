"""The wire (ddipp.core.group.wire): what travels as a stand-in, how what cannot travel is named, and how one message
reaches every worker."""
import ctypes
import socket
import threading
import typing
from multiprocessing.connection import Connection
import weakref
from pathlib import Path

import cloudpickle
import pytest
import torch

from ddipp.core.group.wire import broadcast, dumps, importable_from, loads, receive, unpicklable_path


class Node:
    def __init__(self, **attrs):
        vars(self).update(attrs)


def test_a_closed_file_travels_as_none(tmp_path):
    file = open(tmp_path / "history.csv", "w")
    file.close()
    assert loads(dumps(dict(file=file, n=1))) == dict(file=None, n=1)


def test_what_cannot_be_pickled_is_named_by_its_shortest_path_without_cycles():
    learn = Node()
    logger = Node(learn=learn, handle=threading.Lock())  # reached as learn.cbs.items[1] and as learn.logger
    learn.cbs, learn.logger = Node(items=[Node(learn=learn), logger]), logger
    assert unpicklable_path({"learn": learn, "n_epoch": 1}, {"learn": learn}) == "learn.logger.handle"


def test_a_function_sent_by_value_keeps_the_names_its_string_annotations_read():
    """Strings as `from __future__ import annotations` makes them (fastai 2.7's PILBase.create), which fastcore
    evaluates on the workers: cloudpickle sends only the globals a function's code reads."""
    def create(fn: "Path | str") -> "Path":  # a local function: cloudpickle sends it by value
        return fn

    assert typing.get_type_hints(loads(dumps(create))) == {"fn": Path | str, "return": Path}


def test_a_broadcast_is_written_once_and_each_receiver_maps_it_copy_on_write():
    """As the group sends a learner's data to its workers: the data's arrays out of band, received in place."""
    data = torch.arange(100_000, dtype=torch.float32)
    buffers = []
    blob = dumps({"x": data}, buffers=buffers)
    pairs = [socket.socketpair() for _ in range(3)]
    written = broadcast([Connection(ours.detach()) for ours, _ in pairs], ("keep_data", "digest", blob, buffers))
    received = [receive(Connection(theirs.detach())) for _, theirs in pairs]
    assert data.nbytes < written < data.nbytes + 2 * len(blob) + 1000  # once for all three
    xs = [loads(blob, buffers=got_buffers)["x"] for _, _, blob, got_buffers in received]
    assert all(torch.equal(x, data) for x in xs)
    assert xs[0].data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(received[0][3][0]))  # not copied
    xs[0][0] = -1  # writable, and the write is the receiver's own
    assert xs[1][0] == 0 and xs[2][0] == 0 and data[0] == 0


class Moved(Exception):
    """Stands for fastai v2's CancelFitException: made where its __module__ does not hold it (fastcore's mk_class)."""


Moved.__module__ = "fastcore.basics"


def test_a_class_named_importable_travels_by_reference_so_except_still_catches_it(monkeypatch):
    """cloudpickle sends a class its __module__ does not hold by value: the copy a worker rebuilt was not the class
    fastai's `except CancelFitException` catches. The class a callback raises travels with the callback's code."""
    def stop():
        raise Moved()

    importable_from(__name__, [Moved])
    blobs = dumps(stop), dumps(Moved)
    # received as in a worker's process, where cloudpickle has not seen the class (in this one it would reuse it)
    monkeypatch.setattr(cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_ID", weakref.WeakValueDictionary())
    stop, moved = map(loads, blobs)
    assert moved is Moved
    with pytest.raises(Moved):
        stop()
