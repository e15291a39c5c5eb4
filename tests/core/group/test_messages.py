"""The names on the wire between the notebook's group and its workers: each command is a method of the worker, each
reply a method of the group (the progress events' methods are the adapters' mirrors', tested with each adapter)."""
from ddipp.core.group import messages
from ddipp.core.group.group import WorkerGroup
from ddipp.core.group.worker import Worker

COMMANDS = [messages.SET_CONTEXT, messages.KEEP_DATA, messages.FIT, messages.LEAVE]  # STOP ends the command loop
REPLIES = [messages.READY, messages.DONE, messages.TRAINED, messages.ERROR, messages.OUT]


def test_every_command_is_a_worker_method_and_every_reply_a_group_method():
    assert [name for name in COMMANDS if not callable(getattr(Worker, name, None))] == []
    assert [name for name in REPLIES if not callable(getattr(WorkerGroup, f"_on_{name}", None))] == []


def test_the_names_are_distinct():
    names = [value for name, value in vars(messages).items() if name.isupper()]
    assert len(names) == len(set(names)) >= 20
