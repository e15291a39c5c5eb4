"""Rank 0's progress bars and results table, drawn in the notebook by fastprogress itself.

In the worker, `ProgressRelay` takes the place of fastai's ProgressCallback on rank 0 and hands it bars that draw
nothing and send each call made on them; in the notebook, `ProgressMirror` makes the same calls on the bars plain
fastai makes there (`master_bar`/`progress_bar`: HTML in Jupyter, text in a terminal). One interface, another source.
"""
from typing import Callable

import fastai.callback.progress
from fastai.callback.progress import ProgressCallback
from fastprogress.fastprogress import MasterBar, ProgressBar

from ...core.group.messages import CHILD, CHILD_END, EPOCH, GRAPH, MASTER, MASTER_END, UPDATE, WRITE


class RelayedMasterBar(MasterBar):
    """A master bar over `total` epochs that sends what is done with it."""

    def __init__(self, total: int, send: Callable[[tuple], None]):
        super().__init__(range(total), ProgressBar, total)
        self.send = send
        send((MASTER, total))

    def update(self, val: int) -> None:
        self.send((EPOCH, val))

    def on_iter_end(self) -> None:
        self.send((MASTER_END,))

    def write(self, line, table: bool = False) -> None:
        self.send((WRITE, line, table))

    def update_graph(self, graphs, x_bounds=None, y_bounds=None, figsize=(6, 4)) -> None:
        self.send((GRAPH, graphs, x_bounds, y_bounds, figsize))


class RelayedProgressBar(ProgressBar):
    """A bar over one pass of a loader that sends its updates (with the comment, the smoothed loss) and its end."""

    def __init__(self, total: int, parent: RelayedMasterBar, send: Callable[[tuple], None]):
        super().__init__(range(total), total, parent=parent, leave=False)
        self.send = send
        send((CHILD, total, parent is not None))

    def update(self, val: int) -> None:
        self.send((UPDATE, val, self.comment))

    def on_iter_end(self) -> None:
        self.send((CHILD_END,))


class ProgressRelay(ProgressCallback):
    """fastai's ProgressCallback with relayed bars: the same calls at the same events, drawn in the notebook."""
    name = "progress"  # learn.progress, as the callback it stands in for (ShowGraphCallback draws on its mbar)

    def __init__(self, send: Callable[[tuple], None]):
        self.relay = send

    def before_fit(self) -> None:
        if self.create_mbar:
            self.mbar = RelayedMasterBar(self.n_epoch, self.relay)
        create_mbar, self.learn.create_mbar = self.create_mbar, False  # fastai's before_fit, with this mbar kept
        try:
            super().before_fit()
        finally:
            self.learn.create_mbar = create_mbar

    def _launch_pbar(self) -> None:
        self.pbar = RelayedProgressBar(len(self.dl), getattr(self, "mbar", None), self.relay)
        self.pbar.update(0)


class ProgressMirror:
    """Makes the calls a relayed fit made on its bars on this process's own fastprogress bars: one method per kind of
    event `ProgressRelay` sends, called by name (ddipp.core.group.messages)."""

    def __init__(self):
        self.bar, self.child_bar = None, None

    def __call__(self, kind: str, *args) -> None:
        getattr(self, kind)(*args)

    def master(self, total: int) -> None:
        self.bar = fastai.callback.progress.master_bar(list(range(total)))

    def epoch(self, val: int) -> None:
        self.bar.update(val)

    def master_end(self) -> None:
        self.bar.on_iter_end()

    def write(self, line, table: bool) -> None:
        self.bar.write(line, table=table)

    def graph(self, graphs, x_bounds, y_bounds, figsize) -> None:
        self.bar.update_graph(graphs, x_bounds, y_bounds, figsize)

    def child(self, total: int, has_parent: bool) -> None:
        self.child_bar = fastai.callback.progress.progress_bar(range(total), parent=self.bar if has_parent else None,
                                                               leave=False)

    def update(self, val: int, comment: str) -> None:
        self.child_bar.comment = comment
        self.child_bar.update(val)

    def child_end(self) -> None:
        self.child_bar.on_iter_end()

    def interrupt(self) -> None:
        """Show the bar running when the fit was interrupted as interrupted, as fastprogress does."""
        if self.child_bar is not None and self.child_bar.last_v is not None:
            self.child_bar.on_interrupt()
