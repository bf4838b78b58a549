"""Matching `/`-joined paths against keys: an exact key first, else a full regex match.

`LayoutMap` (leaf paths -> layouts) and `parallelize` (module paths -> styles) select by the
same rules, so one implementation serves both.
"""

import difflib
import re
from collections.abc import Mapping, Sequence


def compile_key(key: object, owner: str) -> re.Pattern:
    """`key` as a regular expression, or a `TypeError` / `ValueError` naming `owner`."""
    if not isinstance(key, str):
        raise TypeError(f"{owner} keys must be strings; got {key!r}.")
    try:
        return re.compile(key)
    except re.error as error:
        raise ValueError(
            f"{owner} key {key!r} is not a valid regular expression ({error}); escape "
            f"special characters with re.escape for a literal path."
        ) from None


def matching_keys(patterns: Mapping[str, re.Pattern], path: str) -> list[str]:
    """The keys that select `path`: the key equal to it if there is one, else every key whose
    regular expression matches the whole path."""
    if path in patterns:
        return [path]
    return [key for key, pattern in patterns.items() if pattern.fullmatch(path)]


def single_match(patterns: Mapping[str, re.Pattern], path: str, owner: str) -> str | None:
    """The one key that selects `path`, `None` if none does; several is a `ValueError`."""
    keys = matching_keys(patterns, path)
    if len(keys) > 1:
        raise ValueError(
            f"{owner}: path {path!r} matches several keys {keys}; make the regular "
            f"expressions exclusive or add the exact path as a key."
        )
    return keys[0] if keys else None


def unused_key_hints(keys: Sequence[str], paths: Sequence[str]) -> str:
    """`'key' (closest paths: [...])` for each key, for messages about keys that match nothing."""
    hints = []
    for key in keys:
        close = difflib.get_close_matches(key, paths, n=3, cutoff=0.4)
        hints.append(f"{key!r} (closest paths: {close})" if close else repr(key))
    return ", ".join(hints)
