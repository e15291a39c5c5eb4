"""The loopback store of a one-host group (the launcher's and a notebook's): it listens on 127.0.0.1 only and serves
the ranks that connect there."""
from datetime import timedelta

import psutil
import torch.distributed as dist

from ddipp.core.store import loopback_listener, loopback_store


def test_the_store_listens_on_loopback_only_and_serves_a_client():
    store = loopback_store(loopback_listener(), timedelta(seconds=30))
    listening = [c.laddr for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert [addr.ip for addr in listening] == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
