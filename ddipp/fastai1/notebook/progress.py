"""Rank 0's progress bars and output, drawn in the notebook by fastprogress itself.

In the worker, `ProgressRelay` turns what fastai's fit does with its master bar (start, epochs, the child
bars of each epoch, the results table, graphs) into events, and `RelayedStream` forwards prints; in the
notebook, `ProgressMirror` replays the events on the notebook's own `master_bar`/`progress_bar` — HTML in
Jupyter, text in a terminal — so a remote fit shows what a local one shows. One interface, another source.
"""
import io
import sys
from contextlib import contextmanager
from typing import Callable, Optional

import fastai.basic_train
from fastai.callback import Callback


class ProgressRelay(Callback):
    """Sends the events of this fit's master bar and its child bars to `send` instead of drawing them."""
    _order = -30  # before the Recorder (-10) writes the table header

    def __init__(self, send: Callable[[tuple], None]):
        self.send = send

    def on_train_begin(self, pbar, **kwargs) -> None:
        if pbar is None:
            return
        send, main, add_child = self.send, pbar.main_bar, pbar.add_child

        def relay_child(child):
            add_child(child)
            send(("child", child.total))
            child.on_update = lambda val, text: send(("child_update", val, child.comment))

        main.on_update = lambda val, text: send(("main", val))
        pbar.add_child = relay_child
        pbar.write = lambda line, table=False: send(("write", line, table))
        pbar.update_graph = lambda graphs, x_bounds=None, y_bounds=None, figsize=(6, 4): send(
            ("graph", graphs, x_bounds, y_bounds))
        pbar.on_interrupt = lambda: send(("interrupt",))
        send(("begin", main.total))


class ProgressMirror:
    """Replays a relayed fit's events on this process's fastprogress bars (those plain fastai would draw): one method
    per kind of event `ProgressRelay` sends, called by name."""

    def __init__(self):
        self.bar, self.child_bar = None, None

    def __call__(self, kind: str, *args) -> None:
        getattr(self, kind)(*args)

    def begin(self, total: int) -> None:
        self.bar = fastai.basic_train.master_bar(range(total))

    def main(self, value: int) -> None:
        self.bar.main_bar.update(value)

    def child(self, total: int) -> None:
        self.child_bar = fastai.basic_train.progress_bar(range(total), parent=self.bar)

    def child_update(self, value: int, comment: str) -> None:
        self.child_bar.comment = comment
        self.child_bar.update(value)

    def write(self, line, table: bool) -> None:
        self.bar.write(line, table=table)

    def graph(self, graphs, x_bounds, y_bounds) -> None:
        self.bar.update_graph(graphs, x_bounds, y_bounds)

    def interrupt(self) -> None:
        """Show the bar as interrupted, as fastprogress does when a local fit raises."""
        if self.bar is not None and self.bar.main_bar.last_v is not None:
            self.bar.main_bar.on_interrupt()


class RelayedStream(io.TextIOBase):
    """A text stream that sends whole lines to `send` as ("out", name, text), with a terminal's carriage return:
    of a line rewritten with '\\r' (console progress bars) only the last version is sent."""

    def __init__(self, name: str, send: Callable[[tuple], None]):
        self.name, self.send, self.pending = name, send, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            self.send(("out", self.name, "".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines.split("\n"))))
        return len(text)

    def close_line(self) -> None:
        """Send what is left of an unfinished line."""
        rest, self.pending = self.pending.rsplit("\r", 1)[-1], ""
        if rest:
            self.send(("out", self.name, rest))


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
