"""ddipp.core.checkpoint: the files a Checkpoint keeps. (Not named test_checkpoint.py: each adapter's tests have one,
and pytest collects tests/core beside them.)"""
import os

import pytest
import torch

from ddipp.core.checkpoint import (DamagedCheckpoint, FromBatch, check_every_steps, check_keep, read_checkpoint,
                                   restart_state, write_checkpoint)


def state(epoch: int, **kwargs) -> dict:
    """What a Checkpoint writes, in short."""
    return dict(model={"w": torch.ones(50)}, opt={}, epoch=epoch, **kwargs)


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
    write_checkpoint(state(1, step=10), tmp_path / "ckpt.pth", 1)
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


class _RunsCode:
    """What an attacker could put in a replaced checkpoint file: unpickling it opens a file."""

    def __reduce__(self):
        return (open, (os.devnull, "w"))


def damage(path, how: str) -> None:
    """`path`, a checkpoint, made `how` a damaged file is."""
    whole = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": whole[:len(whole) // 2], "random": os.urandom(300),
                      "text": b"hello world"}[how])


@pytest.mark.parametrize("how, what", [
    ("empty", r"ckpt\.pth is empty \(0 bytes\)"),
    ("truncated", r"ckpt\.pth is truncated: a zip archive of \d+ bytes without its end"),
    ("random", r"ckpt\.pth is not a checkpoint: 300 bytes that are not the zip archive torch\.save writes"),
    ("text", r"ckpt\.pth is not a checkpoint: 11 bytes that are not the zip archive torch\.save writes"),
    ("code", r"ckpt\.pth is not a checkpoint ddipp wrote: it holds \S*open, which a weights-only load refuses"),
    ("learn.save", r"ckpt\.pth is not a checkpoint ddipp wrote: a dict without the model, opt and epoch a Checkpoint "
                   r"writes \(learn\.save's files load with learn\.load\)"),
    ("state dict", r"ckpt\.pth is not a checkpoint ddipp wrote: a OrderedDict without the model"),
])
def test_a_damaged_file_is_refused_naming_it_what_is_wrong_and_the_fix_never_an_unsafe_load(tmp_path, how, what):
    path = tmp_path / "ckpt.pth"
    write_checkpoint(state(2), path, 1)
    if how == "code":
        torch.save(dict(state(2), payload=_RunsCode()), path)
    elif how == "learn.save":
        torch.save(dict(model={"w": torch.ones(2)}, opt={}), path)
    elif how == "state dict":
        torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    else:
        damage(path, how)
    with pytest.raises(DamagedCheckpoint, match=f"^start_epoch=2: {tmp_path}/{what}.*; put an earlier kept file "
                                                r"\(ckpt\.1\.pth, with Checkpoint\(keep=2\) or more\) in its place, "
                                                r"or fit from the start \(no start_epoch\)$") as refused:
        read_checkpoint(path, 2)
    assert "weights_only" not in str(refused.value) and refused.value.__cause__ is None
    assert refused.value.__suppress_context__  # torch's advice to load it unsafely is not printed either


def test_after_a_restart_the_newest_kept_file_that_reads_back_is_taken_and_what_was_wrong_said(tmp_path):
    path = tmp_path / "ckpt.pth"
    assert restart_state(path, 3) == (None, path, None)
    for epoch in range(1, 4):
        write_checkpoint(state(epoch), path, 3)
    saved, file, damaged = restart_state(path, 3)
    assert (saved["epoch"], file, damaged) == (3, path, None)
    damage(path, "truncated")
    saved, file, damaged = restart_state(path, 3)
    assert (saved["epoch"], file.name) == (2, "ckpt.1.pth")
    assert damaged.startswith(f"{path} is truncated: a zip archive of ")
    damage(tmp_path / "ckpt.1.pth", "empty")
    saved, file, damaged = restart_state(path, 3)
    assert (saved["epoch"], file.name) == (1, "ckpt.2.pth")
    assert damaged.endswith(f"without its end; {tmp_path}/ckpt.1.pth is empty (0 bytes)")
    assert restart_state(path, 2)[:2] == (None, path)  # keep=2: ckpt.2.pth is not one of its files
