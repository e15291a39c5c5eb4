"""Files ddipp writes: replaced atomically (a crash leaves the previous file whole); what dead processes left, swept.

A file being written is `.NAME.PID.tmp` beside its target until it is complete; a folder of a process's own is
named with its PID. Either is removed by a later process once that PID is gone.
"""
import glob
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import torch


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (a zombie included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A file to write `path`'s new content to; when the block ends without error it replaces `path` atomically.

    The data and the rename are fsynced, so after a crash `path` holds the old content or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_tmp(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def save_atomic(obj, path: Path) -> None:
    """torch.save `obj` to `path` through `replacing`: `path` is either the old file or the new."""
    with replacing(path) as f:
        torch.save(obj, f)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep_stale_tmp(path: Path) -> None:
    """Remove the temporary files of `path` left by processes killed while writing it."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdecimal() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def owned_dir_prefix(kind: str) -> str:
    """The name prefix of a folder this process owns (for tempfile.mkdtemp); `sweep_stale_dirs(kind)` finds it."""
    return f"{kind}-{os.getpid()}-"


def sweep_stale_dirs(parent: Path, kind: str) -> None:
    """Remove the folders named by `owned_dir_prefix(kind)` in `parent` whose process is gone."""
    for folder in parent.glob(f"{kind}-*-*"):
        match = re.fullmatch(rf"{re.escape(kind)}-(\d+)-.*", folder.name)
        if match and folder.is_dir() and not pid_alive(int(match[1])):
            shutil.rmtree(folder, ignore_errors=True)


class UnnamedFile:
    """A path whose `open` makes a file with no name (tempfile.TemporaryFile), for a CSV logger on ranks other than
    0: nothing stays on disk, however the process ends. `folder / UnnamedFile()` is itself (fastai v2 joins its
    logger's path so). Not os.devnull: fastai v1's CSVLogger fsyncs its file, which /dev/null refuses."""

    def __rtruediv__(self, folder) -> "UnnamedFile":
        return self

    @property
    def parent(self) -> Path:  # CSVLogger makes its file's folder: this one exists
        return Path(tempfile.gettempdir())

    def exists(self) -> bool:
        return False

    def open(self, mode: str):
        return tempfile.TemporaryFile(mode)


@contextmanager
def writing_as_rank_0() -> Iterator[None]:
    """In the block, this process passes for rank 0 to code that reads RANK (fastai's save and export write nothing
    elsewhere): for writing into a buffer of its own, which every rank may ask for."""
    rank = os.environ.get("RANK")
    os.environ["RANK"] = "0"
    try:
        yield
    finally:
        if rank is None:
            del os.environ["RANK"]
        else:
            os.environ["RANK"] = rank
