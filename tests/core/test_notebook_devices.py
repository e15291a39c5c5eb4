"""ddipp.core.options.notebook_devices: what to_ddp(nprocs=..., gpus=...) of a notebook asks for, refused in one line
naming the value and the limit when this host cannot run it."""
import re

import pytest

from ddipp.core.options import notebook_devices


def test_more_cpu_processes_than_the_memory_holds_are_refused_naming_the_limit():
    """nprocs=10**6 was accepted, and the group then built an environment per worker (50 MB/s) before starting one."""
    assert notebook_devices(None, 2) == ("cpu", "cpu")
    with pytest.raises(ValueError) as raised:
        notebook_devices(None, 10**6)
    said = re.fullmatch(r"to_ddp\(nprocs=1000000\): this host has memory for at most (\d+) worker processes \(\S+ GB "
                        r"available, about (\d+) MB a worker (?:forked from the kernel|started) before its first "
                        r"fit\): use nprocs <= (\d+)", str(raised.value))
    assert said and said[1] == said[3] and int(said[1]) >= 1, raised.value
    assert notebook_devices(None, int(said[1])) == ("cpu",) * int(said[1])
