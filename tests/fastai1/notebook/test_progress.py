"""The progress relay and its mirror: every kind of event rank 0's relay sends has a method of that name here."""
from fastai.train import ShowGraph

from ddipp.fastai1.notebook.progress import ProgressMirror, ProgressRelay
from scenario import digits_data, digits_learner


def test_every_event_the_relay_sends_is_one_the_mirror_replays(tmp_path):
    events = []
    learn = digits_learner(digits_data(tmp_path, bs=32))
    learn.callback_fns.append(ShowGraph)
    learn.fit(2, 1e-2, callbacks=[ProgressRelay(events.append)])
    kinds = {kind for kind, *_ in events}
    assert {"begin", "main", "child", "child_update", "write", "graph"} <= kinds
    assert all(callable(getattr(ProgressMirror, kind, None)) for kind in kinds)
    mirror = ProgressMirror()
    for event in events:
        mirror(*event)
    assert mirror.bar.main_bar.total == 2 and mirror.child_bar.total == 6  # the last child: 359 items to validate
