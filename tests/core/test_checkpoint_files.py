"""ddipp.core.checkpoint: the files a Checkpoint keeps. (Not named test_checkpoint.py: each adapter's tests have one,
and pytest collects tests/core beside them.)"""
import pytest
import torch

from ddipp.core.checkpoint import (FromBatch, check_every_steps, check_keep, read_checkpoint,
                                   write_checkpoint)


@pytest.mark.parametrize("keep, expected", [(1, {"ckpt.pth": 4}),
                                            (3, {"ckpt.pth": 4, "ckpt.1.pth": 3, "ckpt.2.pth": 2})])
def test_the_last_checkpoints_stay_newest_first(tmp_path, keep, expected):
    for epoch in range(1, 5):
        write_checkpoint({"epoch": epoch}, tmp_path / "ckpt.pth", keep)
    assert {p.name: torch.load(p, weights_only=True)["epoch"] for p in tmp_path.iterdir()} == expected


@pytest.mark.parametrize("keep", [0, 1.5, True, "2"])
def test_keep_must_be_a_whole_number_of_files(keep):
    with pytest.raises(ValueError, match=r"keep is how many checkpoint files stay, a whole number >= 1"):
        check_keep(keep)


@pytest.mark.parametrize("every_steps", [0, 2.5, True, "100"])
def test_every_steps_must_be_a_whole_number_of_batches(every_steps):
    with pytest.raises(ValueError, match=rf"Checkpoint\(every_steps={every_steps!r}\): every_steps is how many "
                                         r"training batches go between two checkpoints in an epoch, a whole number"):
        check_every_steps(every_steps)


def test_a_start_epoch_that_is_not_the_files_names_how_far_the_file_went(tmp_path):
    write_checkpoint({"epoch": 1, "step": 10}, tmp_path / "ckpt.pth", 1)
    with pytest.raises(ValueError, match=r"holds the state after epoch 1 and 10 batches of epoch 2; pass "
                                         r"start_epoch=1"):
        read_checkpoint(tmp_path / "ckpt.pth", 2)


def test_from_batch_reads_and_drops_the_batches_before_its_start_then_puts_the_generators_back():
    events = []

    def loader():
        for k in range(5):
            events.append(f"read {k}")
            yield k
    resumed = FromBatch(loader(), 2, lambda: events.append("generators"))
    assert list(resumed) == [2, 3, 4]
    assert events == ["read 0", "read 1", "generators", "read 2", "read 3", "read 4"]
