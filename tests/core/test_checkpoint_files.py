"""ddipp.core.checkpoint: the files a Checkpoint keeps. (Not named test_checkpoint.py: each adapter's tests have one,
and pytest collects tests/core beside them.)"""
import pytest
import torch

from ddipp.core.checkpoint import check_keep, write_checkpoint


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
