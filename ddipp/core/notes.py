"""Notes on exceptions (PEP 678) on every Python ddipp supports: BaseException.add_note is Python 3.11's."""


def add_note(error: BaseException, note: str) -> None:
    """Add `note` to `error`'s __notes__, which a traceback prints after the error from Python 3.11 (3.10 keeps it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]
