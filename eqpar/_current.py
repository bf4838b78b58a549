"""The current distribution: one process-wide stack, so every thread sees the same one.

Shared by `distributions.py` (which owns the public `set_distribution` / `distribution` /
`Distribution.scope`) and `spmd.py` (whose `build_sharded` reads the current distribution
when given no mesh). It stores objects without knowing their type, so that neither of those
modules needs to import the other.
"""

import contextlib
import itertools
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_base: object | None = None
_scopes: list[tuple[int, object | None]] = []
_tokens = itertools.count()


def current() -> object | None:
    """The innermost active scope's value, else the process-wide one, else `None`."""
    with _lock:
        return _scopes[-1][1] if _scopes else _base


def set_current(value: object | None) -> None:
    """Replace the innermost scope's value, or the process-wide one outside any scope."""
    global _base
    with _lock:
        if _scopes:
            _scopes[-1] = (_scopes[-1][0], value)
        else:
            _base = value


@contextlib.contextmanager
def scoped(value: object) -> Iterator[None]:
    """`value` is current inside the block (scopes nest; each ends only its own entry)."""
    token = next(_tokens)
    with _lock:
        _scopes.append((token, value))
    try:
        yield
    finally:
        with _lock:
            for i in range(len(_scopes) - 1, -1, -1):
                if _scopes[i][0] == token:
                    del _scopes[i]
                    break
