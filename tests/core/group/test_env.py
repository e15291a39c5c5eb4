"""The environment a rank of a notebook's worker group starts in, asserted without starting a process: torch elastic's
variables for one host, ddipp's (dist.rank_env, which the launcher uses too), the adapter's fitting module."""
import os
from pathlib import Path

import pytest

import ddipp.core
from ddipp.core.group.group import worker_env
from ddipp.launch import config_from_args, parse

FITTING = "ddipp.fastai2.notebook.fitting"
PACKAGE_ROOT = str(Path(ddipp.core.__file__).parents[2])  # the folder that holds ddipp


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))


def test_a_rank_of_a_gpu_group_gets_torch_elastics_variables_its_gpu_list_and_a_share_of_the_cores(eight_cores):
    env = worker_env(1, ("cuda:3", "cuda:1"), 42.5, 29611, FITTING, environ={"PATH": "/bin", "PYTHONPATH": "/mine"})
    assert env == {"PATH": "/bin", "PYTHONPATH": os.pathsep.join([PACKAGE_ROOT, "/mine"]),
                   "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611",
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                   "DDIPP_DEVICES": "3,1", "DDIPP_TIMEOUT": "42.5", "DDIPP_FITTING": FITTING,
                   "DDIPP_PARENT_PID": str(os.getpid()), "OMP_NUM_THREADS": "4",
                   "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}


def test_the_notebooks_own_settings_win(eight_cores):
    mine = {"OMP_NUM_THREADS": "3", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth1"}
    env = worker_env(0, ("cpu",) * 4, 600, 29611, FITTING, environ=mine)
    assert {name: env[name] for name in mine} == mine
    assert (env["DDIPP_DEVICES"], env["WORLD_SIZE"], env["PYTHONPATH"]) == ("cpu", "4", PACKAGE_ROOT)


def test_one_rank_has_the_host_to_itself(eight_cores):
    assert "OMP_NUM_THREADS" not in worker_env(0, ("cpu",), 600, 29611, FITTING, environ={})


@pytest.mark.parametrize("nproc", [1, 3])
def test_the_launcher_gives_its_ranks_what_the_notebook_gives_its_workers(eight_cores, nproc):
    args = parse(["--nproc", str(nproc), "--timeout", "42.5", __file__])
    notebook = worker_env(0, ("cpu",) * nproc, 42.5, 29611, FITTING, environ={})
    assert config_from_args(args, environ={}).env.items() <= notebook.items()
