"""What each rank of a notebook's group keeps between fits (ddipp.core.group: `WorkerGroup.held`, rank by rank): a
bound learner's next fit request is made once for each distinct set the ranks keep, and each rank gets the one that
names only its own tensors as digests (a sharding strategy keeps a different part on each rank; DDP the same on all),
on 2 CPU ranks with the plain-torch fitting module tests/core/workers/torch_fitting.py."""
from functools import partial

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from ddipp.core.group import binding
from ddipp.core.group.group import _groups, shutdown
from ddipp.core.group.wire import HeldTensors, dumps, loads, tensor_digest
from ddipp.core.options import Options
from torch_fitting import Keeping

CPU2 = ("cpu", "cpu")
FITTING = "torch_fitting"  # tests/core/workers/torch_fitting.py


@pytest.fixture(autouse=True)
def no_group_left():
    yield
    shutdown()


class _Bound:
    """A learner as far as ddipp.core.group.binding needs one: its data, and what bind sets on it."""
    data = torch.arange(4.0)


def tensors() -> dict:
    """Tensors of 2 kB (large enough to travel by digest): A0 and A1 one rank's each, C and B both ranks'."""
    return {name: torch.full((512,), float(i)) for i, name in enumerate(["A0", "A1", "C", "B"])}


def keep(kept_by_rank, named, seed, data, device):
    """Keep rank r's `kept_by_rank[r]` (names of `named`, the tensors this call carried); their sum all-reduced, and
    every rank's `seed` (drawn as ddipp's fit requests draw theirs)."""
    mine = [named[name] for name in kept_by_rank[dist.get_rank()]]
    total = sum(t.sum() for t in named.values()).reshape(1)
    dist.all_reduce(total)
    seeds = [None] * dist.get_world_size()
    dist.all_gather_object(seeds, seed)
    return Keeping((float(total), seeds), mine)


class _Names(HeldTensors):
    """A worker's held tensors as a request's reader here: it records the digests the request names."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def take(self, digest):
        self.names.add(digest)
        return torch.zeros(512)


def named(call: bytes) -> set:
    """The digests of the tensors a fit request names instead of carrying them."""
    reader = _Names()
    loads(call, held=reader)
    return reader.names


@pytest.mark.slow  # starts a worker group
def test_each_rank_gets_a_request_naming_its_own_tensors_and_equal_sets_make_one():
    learn, made, results = _Bound(), [], []
    binding.bind(learn, CPU2, Options(timeout=60), binding.fit_on_group, FITTING)
    t = tensors()
    digest = {name: tensor_digest(tensor) for name, tensor in t.items()}

    def fit(kept_by_rank):
        """A bound learner's fit whose request carries every tensor of `t` and keeps `kept_by_rank` on each rank."""
        made.clear()

        def call(held):
            seed = int(torch.randint(0, 2**31 - 1, ()))
            made.append((held, dumps(partial(keep, kept_by_rank, t, seed), held=held)))
            return made[-1][1]
        learn.fit("data", call, None, lambda sent: results.append(cloudpickle.loads(sent[0])), kept=lambda: (0, 0))
        group = _groups[CPU2]
        total, seeds = results.pop()
        assert total == 2 * sum(float(x.sum()) for x in t.values())  # every tensor arrived, on both ranks
        assert seeds[0] == seeds[1]  # each request drew the same seed
        return group, [(held, named(request)) for held, request in made]  # each request made: its held, its names

    group, requests = fit([["A0", "C"], ["A1", "C"]])
    assert requests == [(frozenset(), set())]  # before the first fit: one request, every tensor by value
    own = [frozenset({digest["A0"], digest["C"]}), frozenset({digest["A1"], digest["C"]})]
    assert group.held == {0: own[0], 1: own[1]}

    group, requests = fit([["B", "C"], ["B", "C"]])  # a rank sent the other's request fails: it holds no such tensor
    assert requests == [(own[0], own[0]), (own[1], own[1])]
    assert group.last_sent["call"] == sum(len(request) for _, request in made)

    group, requests = fit([["B"], ["B"]])  # equal sets: one request, written once for both ranks
    assert requests == [({digest["B"], digest["C"]}, {digest["B"], digest["C"]})]  # what changed (A0, A1) by value
    assert group.last_sent["call"] == len(made[0][1])
    assert group.held == {0: {digest["B"]}, 1: {digest["B"]}}
