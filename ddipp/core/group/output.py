"""Rank 0's prints and warnings during a notebook fit, sent to the notebook line by line (fastai-free)."""
import io
import sys
from contextlib import contextmanager
from typing import Callable, Optional

from .messages import OUT


class RelayedStream(io.TextIOBase):
    """A text stream that sends whole lines to `send` as (OUT, name, text), with a terminal's carriage return:
    of a line rewritten with '\\r' (console progress bars) only the last version is sent."""

    def __init__(self, name: str, send: Callable[[tuple], None]):
        self.name, self.send, self.pending = name, send, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            self.send((OUT, self.name, "".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines.split("\n"))))
        return len(text)

    def close_line(self) -> None:
        """Send what is left of an unfinished line."""
        rest, self.pending = self.pending.rsplit("\r", 1)[-1], ""
        if rest:
            self.send((OUT, self.name, rest))


@contextmanager
def relayed_output(send: Optional[Callable[[tuple], None]]):
    """Within the block, this process's prints and warnings go to `send` (nothing changes when it is None)."""
    if send is None:
        yield
        return
    streams = RelayedStream("stdout", send), RelayedStream("stderr", send)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = streams
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for stream in streams:
            stream.close_line()
