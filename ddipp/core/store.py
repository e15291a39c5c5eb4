"""The rendezvous store of a one-host group (the launcher's, a notebook's), listening on 127.0.0.1 only.

torch's TCPStore listens on every interface whatever host it is given, so it serves from a socket bound here."""
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a store is made: the launcher refuses bad input before
    from torch.distributed import TCPStore

LOOPBACK = "127.0.0.1"


def loopback_listener(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1 at `port` (0: a free one the OS picks) for `loopback_store`; OSError if the
    port cannot be had."""
    return socket.create_server((LOOPBACK, port))


def loopback_store(listener: socket.socket, timeout: timedelta) -> "TCPStore":
    """The store served from `listener`, which it takes over and closes when released. libuv's
    backend (torch's default since 2.4) cannot take a listening socket: the store uses the one before it."""
    from torch.distributed import TCPStore

    port = listener.getsockname()[1]
    return TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach(),
                    use_libuv=False, timeout=timeout)
