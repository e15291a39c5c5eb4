"""The rank helpers: single-process values when not launched, the group's values in a real 2-process run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddipp
from conftest import launch_2_ranks
from ddipp.core import dist

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", dist.DEVICES_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_single_process_values_when_not_launched(clean_env):
    assert not dist.launched()
    assert (ddipp.rank(), ddipp.world_size(), ddipp.is_rank0()) == (0, 1, True)
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert ddipp.device() == expected
    ddipp.barrier()  # returns at once: there is nobody to wait for
    assert not dist.init() and not torch.distributed.is_initialized()


@pytest.mark.parametrize("devices, local_rank, expected", [
    ("3,1", 0, "cuda:3"), ("3,1", 1, "cuda:1"), ("0,3", 1, "cuda:3"), ("3,2,1,0", 2, "cuda:1"), ("cpu", 1, "cpu")])
def test_local_rank_i_runs_on_the_ith_listed_device(clean_env, devices, local_rank, expected):
    clean_env.setenv(dist.DEVICES_ENV, devices)
    clean_env.setenv("LOCAL_RANK", str(local_rank))
    assert ddipp.device() == torch.device(expected)


@pytest.mark.slow
def test_helpers_in_a_two_process_gloo_group(tmp_path):
    launch_2_ranks(Path(__file__).parent / "workers" / "dist_worker.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["before_init"] == dict(rank=r, world_size=2, device="cpu")
        assert (got["rank"], got["world_size"], got["is_rank0"]) == (r, 2, r == 0)
        assert got["device"] == "cpu"
        assert got["backend"] == "gloo"
        assert got["marker_seen_after_barrier"]


@pytest.mark.slow
def test_a_rank_stopped_by_a_peers_failure_names_that_rank_and_its_error(tmp_path):
    launch_2_ranks(Path(__file__).parents[1] / "workers" / "leave_worker.py", tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert not r1["peer_failure"] and r1["notes"] == []  # its own error, posted, not annotated
    assert r0["peer_failure"]
    assert r0["notes"] == ["ddipp: this rank stopped because rank 1 failed, with:\nValueError: rank 1 fails on purpose"]
    for rank in (r0, r1):  # both left the group at once and run alone
        assert (rank["world_size_after"], rank["initialized_after"]) == (1, False)


@pytest.mark.slow
@pytest.mark.parametrize("cores, ranks, default, chosen, expected", [
    (8, 2, 8, 8, 4), (16, 8, 16, 16, 2), (2, 4, 2, 2, 1), (8, 2, 8, 3, 3), (8, 2, 8, 0, 0), (8, 1, 8, 8, 8)])
def test_a_loader_left_at_fastais_default_gets_the_ranks_share_of_the_cores(monkeypatch, cores, ranks, default,
                                                                             chosen, expected):
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert dist.loader_workers(chosen, default) == expected  # a number the user chose (not the default) stays


def test_every_rank_and_restart_of_a_launch_reads_the_id_the_first_set_and_a_new_launch_another():
    launch = torch.distributed.HashStore()  # the launcher's store, which torch elastic keeps across restarts
    first = dist.agree_launch_id(launch)
    assert [dist.agree_launch_id(launch) for _ in range(3)] == [first] * 3
    assert dist.agree_launch_id(torch.distributed.PrefixStore("/worker/attempt_1", launch)) == first  # older torch
    assert dist.agree_launch_id(torch.distributed.HashStore()) != first


@pytest.mark.slow
def test_a_rank_killed_while_telling_the_launcher_its_error_leaves_no_unreadable_error_file(tmp_path):
    """torch's elastic agent json-loads the error file of a rank that ended: one cut short (the agent stops the other
    ranks while they write theirs) crashed the agent, and with it a launch that had restarts left. The rank here is
    killed by the file size limit while it writes (SIGXFSZ), as by SIGTERM: the file is whole or absent."""
    file = tmp_path / "error.json"
    code = (f"import os, resource; from ddipp.core import dist; os.environ[dist.ERROR_FILE_ENV] = {str(file)!r}; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); "
            "dist._tell_launcher(ValueError('x'), 'a line longer than the limit lets a file hold ' * 4)")
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ended.returncode != 0  # the limit stopped the write
    assert not file.exists() or json.loads(file.read_text())["message"]["message"]
