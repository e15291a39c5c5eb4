"""learn.bs_find() on fastai v2 against a per-rank memory ceiling (bs_find_story.Ceiling: a layer raising
torch.OutOfMemoryError when a training batch passes its rank's ceiling): the largest size every rank takes, in one
process, on 2 launched ranks (DDP, split_batches, shard=True) and in notebook mode; the learner as it was (its
attributes, weights, optimizer, loaders, generators: a fit after bs_find is the fit without it, bit for bit)."""
import pytest
import torch

import ddipp
from bs_find_story import CEILINGS, changed, learner, on_torch_loaders, snapshot, story
from conftest import ROOT, launch_2_ranks, rank_files
from ddipp.core.sharding import part_sizes
from fit_story import N_TRAIN
from stories import RNNLike


def largest(fits, items: int, start: int = 2) -> int:
    """The reference: the largest size from `start` to `items` that `fits`."""
    return max(size for size in range(start, items + 1) if fits(size))


def assert_as_before(res: dict, found: int) -> None:
    assert res["found"] == found
    assert res["changed"] == [] and res["patched"] == []
    assert len(res["after"]) == len(res["without"]) == 9  # 2 linear layers (4), BatchNorm (2 parameters, 3 buffers)
    for i, (a, b) in enumerate(zip(res["after"], res["without"])):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


def test_one_process_finds_the_ceiling_and_leaves_the_learner_as_it_was(tmp_path, capsys):
    assert_as_before(story(lambda learn: learn, tmp_path), largest(lambda size: size <= CEILINGS[0], N_TRAIN))
    shown = capsys.readouterr().out
    assert "        40  fits" in shown and "        41  out of memory" in shown
    assert "bs_find: the largest batch size that fits: 40" in shown and "global batch" not in shown


def test_a_recurrent_models_output_gives_the_loss_its_first(tmp_path):
    from fastai.callback.rnn import RNNCallback
    learn = learner(tmp_path)
    learn.model, learn.splitter = RNNLike(learn.model), lambda model: [list(model.parameters())]
    learn.add_cb(RNNCallback())
    assert learn.bs_find(max_bs=8) == 8


def test_recomputed_blocks_on_pytorch_loaders(tmp_path):
    """Recompute's blocks recompute in the trials (its order, -7, is before the finder's) and are put back after."""
    res = story(lambda learn: on_torch_loaders(learn).add_cb(ddipp.Recompute()), tmp_path)
    assert_as_before(res, 40)
    assert res["patched"] == []


def test_a_learner_without_an_optimizer_keeps_none(tmp_path):
    learn = learner(tmp_path)
    assert learn.bs_find(start=8) == 40 and learn.opt is None
    assert_as_before(story(lambda learn: learn, tmp_path, fresh=True), 40)


@pytest.mark.parametrize("sizes, message", [
    (dict(start=0), "start=0; a batch holds 1 item or more"),
    (dict(start=1), "start=1 gives a process 1 item a step, and the model's BatchNorm cannot train on fewer than 2: "
                    "give start=2 or more"),
    (dict(start=64, max_bs=32), "max_bs=32 is below start=64"),
    (dict(max_bs=N_TRAIN + 1), f"max_bs={N_TRAIN + 1} is above the training set's {N_TRAIN} items"),
    (dict(start=N_TRAIN + 1), f"the training set holds {N_TRAIN} items, fewer than start={N_TRAIN + 1}")])
def test_bad_sizes_are_refused_before_any_work(tmp_path, sizes, message):
    learn = learner(tmp_path)
    before = snapshot(learn)
    with pytest.raises(ValueError, match=message):
        learn.bs_find(**sizes)
    assert changed(before, snapshot(learn)) == [] and not (tmp_path / "history.csv").exists()  # no fit began


def test_out_of_memory_at_the_start_names_the_size_and_the_learner_trains_after(tmp_path):
    learn = learner(tmp_path, ceilings=(20, 20)).add_cb(ddipp.Recompute())  # its batch is 16
    learn.fit(1, 1e-2)
    before = snapshot(learn)
    with pytest.raises(torch.OutOfMemoryError, match="batch size 32 .*split_batches=True.*shard=True.*Recompute"):
        learn.bs_find(start=32)
    assert changed(before, snapshot(learn)) == []
    assert [name for name, m in learn.model.named_modules() if "forward" in vars(m)] == []  # the fit's end ran
    learn.fit(1, 1e-2)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("bs_find")
    launch_2_ranks(ROOT / "tests" / "fastai2" / "workers" / "bs_find_worker.py", out)
    return rank_files(out), [(out / f"stdout{r}.txt").read_text() for r in range(2)]


@pytest.mark.slow
def test_two_launched_ranks_agree_on_the_largest_batch_both_take(launched):
    ranks, (shown, quiet) = launched
    share = N_TRAIN // 2  # a rank's items without split_batches
    for rank in ranks:
        assert_as_before(rank["ddp"], largest(lambda size: size <= min(CEILINGS), share))  # 23: rank 1's
        assert_as_before(rank["shard"], 23)
        assert_as_before(rank["split"], largest(lambda size: max(part_sizes(size, 2)) <= min(CEILINGS), N_TRAIN))
    assert "bs_find: bs=23 per process: global batch 46 = 23 x 2 processes" in shown
    assert "bs_find: global batch 46 (23 + 23 over 2 processes, split_batches)" in shown
    assert "shard=True: the trials ran the whole model on each process" in shown
    assert "bs_find" not in quiet


@pytest.mark.slow
def test_launched_refusals_leave_the_learner_and_the_group_as_they_were(launched):
    ranks, _ = launched
    for rank in ranks:
        name, message, what_changed = rank["start_fails"]  # rank 1 takes no batch of 32; the next fit trains
        assert name == "OutOfMemoryError" and "batch size 32 (start)" in message and what_changed == []
        name, message, what_changed = rank["share"]
        assert name == "ValueError" and f"max_bs={N_TRAIN // 2 + 1} is above the training set's {N_TRAIN // 2}" \
            in message and what_changed == []
        name, message, what_changed = rank["split_one_item"]  # 2 + 1 items: BatchNorm cannot train on the one
        assert name == "ValueError" and "start=3 gives a process 1 item a step" in message and "start=4" in message
        assert what_changed == []


@pytest.mark.slow
def test_a_notebook_learner_finds_what_its_workers_agree_on(tmp_path, capsys):
    assert_as_before(story(lambda learn: learn.to_ddp(nprocs=2), tmp_path), 23)
    shown = capsys.readouterr().out
    assert "bs_find: the largest batch size that fits: 23" in shown
    assert "bs_find: bs=23 per process: global batch 46 = 23 x 2 processes" in shown
    learn = learner(tmp_path, ceilings=(40, 20)).to_ddp(nprocs=2)  # the workers' error comes back; the group fits on
    with pytest.raises(torch.OutOfMemoryError, match="batch size 32 \\(start\\)"):
        learn.bs_find(start=32)
    learn.fit(1, 1e-2)
    learn.from_ddp()
