"""Rank 0's progress bars and output, drawn in the notebook by fastprogress itself.

In the worker, `ProgressRelay` turns what fastai's fit does with its master bar (start, epochs, the child
bars of each epoch, the results table, graphs) into events (prints go through ddipp.core.group.output); in the
notebook, `ProgressMirror` replays the events on the notebook's own `master_bar`/`progress_bar` — HTML in
Jupyter, text in a terminal — so a remote fit shows what a local one shows. One interface, another source.
"""
from typing import Callable

import fastai.basic_train
from fastai.callback import Callback

from ...core.group.messages import BEGIN, CHILD, CHILD_UPDATE, GRAPH, INTERRUPT, MAIN, WRITE


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
            send((CHILD, child.total))
            child.on_update = lambda val, text: send((CHILD_UPDATE, val, child.comment))

        main.on_update = lambda val, text: send((MAIN, val))
        pbar.add_child = relay_child
        pbar.write = lambda line, table=False: send((WRITE, line, table))
        pbar.update_graph = lambda graphs, x_bounds=None, y_bounds=None, figsize=(6, 4): send(
            (GRAPH, graphs, x_bounds, y_bounds))
        pbar.on_interrupt = lambda: send((INTERRUPT,))
        send((BEGIN, main.total))


class ProgressMirror:
    """Replays a relayed fit's events on this process's fastprogress bars (those plain fastai would draw): one method
    per kind of event `ProgressRelay` sends, called by name (ddipp.core.group.messages)."""

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
