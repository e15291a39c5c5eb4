"""The wire's pickling (ddipp.core.group.wire): what travels as a stand-in, and how what cannot travel is named."""
import threading
import typing
from pathlib import Path

from ddipp.core.group.wire import dumps, loads, unpicklable_path


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
