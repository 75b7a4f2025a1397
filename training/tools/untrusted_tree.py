"""Walking nested data read from an untrusted file: iteratively, bounded, every container once.

A pickle (``torch.load(weights_only=True)`` still builds any nesting of dicts, lists and tuples) can make a
structure no recursive walk survives: a few hundred bytes whose dicts each hold the next one twice (the memo makes
one object reachable by 2^30 paths: a recursive walk runs for ever), a dict nested 100,000 deep (``RecursionError``),
a dict that holds itself. :func:`leaves` walks with an explicit stack, at most :data:`MAX_DEPTH` containers deep and
:data:`MAX_ENTRIES` entries in all, and tracks object ids: a container reached by a second path is not walked again
(its leaves are listed once, under the first path), a container inside itself is refused. Each refusal is one
:class:`TreeError` line naming the file and the path.
"""
from __future__ import annotations

import argparse
from typing import Any

from megatron_ds_suite.core.errors import SuiteError

MAX_DEPTH = 64
"""Containers inside one another (a Megatron-LM checkpoint nests about 6 deep: optimizer -> state -> param ->
exp_avg)."""
MAX_ENTRIES = 1_000_000
"""Entries of all containers together (a rank file of a large model holds some 10,000)."""


class TreeError(SuiteError):
    """A structure too deep, too large or cyclic to be data a program saved (one line)."""


def shown(value: Any) -> str:
    """A value for a message: scalars as written (cut at 60 characters), containers and objects by type only (no
    recursion into them, no conversion of an int past Python's digit limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 18:
        return "a huge int"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)[:60]
    return f"a {type(value).__name__}"


def _entries(obj: Any) -> list[tuple[Any, Any]] | None:
    """(key, value) pairs of a container (keys of lists/tuples/sets: positions), None for a leaf."""
    if isinstance(obj, dict):
        return list(obj.items())
    if isinstance(obj, argparse.Namespace):
        return list(vars(obj).items())
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    if isinstance(obj, (set, frozenset)):
        return list(enumerate(obj))
    return None


def _key(key: Any) -> str | int:
    """A path element: str and int keys as they are, any other key by its type (never its repr)."""
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and abs(key) < 10 ** 18):
        return key
    return f"<{type(key).__name__}>"


def path_name(path: tuple) -> str:
    return ".".join(map(str, path)) or "the top level"


def leaves(root: Any, where: str, max_depth: int = MAX_DEPTH, max_entries: int = MAX_ENTRIES
           ) -> list[tuple[tuple, Any]]:
    """[(path, leaf)] of ``root`` in depth-first order of its entries (a path: the keys from ``root``; a leaf:
    anything not a dict, list, tuple, set or Namespace), a container's own leaves before those of the containers it
    holds. ``where`` (the file) starts each refusal (module docstring)."""
    out: list[tuple[tuple, Any]] = []
    seen: set[int] = set()
    entries = 0
    # (container, its path, ids of the containers on its path, itself included)
    stack: list[tuple[Any, tuple, tuple[int, ...]]] = []
    if _entries(root) is None:
        return [((), root)]
    stack.append((root, (), (id(root),)))
    while stack:
        obj, path, above = stack.pop()
        if id(obj) in seen:  # reached again by another path: listed once
            continue
        seen.add(id(obj))
        items = _entries(obj)
        entries += len(items)
        if entries > max_entries:
            raise TreeError(f"{where} holds more than {max_entries:,} entries (at {path_name(path)}): not data a "
                            f"checkpoint holds; do not use files from an untrusted source")
        children = []
        for key, value in items:
            child = path + (_key(key),)
            if _entries(value) is None:
                out.append((child, value))
                continue
            if id(value) in above:
                raise TreeError(f"{where}: {path_name(child)} is a container it lies inside (a cyclic structure): not "
                                f"data a checkpoint holds; do not use files from an untrusted source")
            if len(child) >= max_depth:  # ``child`` would be container number max_depth + 1 on its path
                raise TreeError(f"{where} nests containers more than {max_depth} deep (at {path_name(child[:8])}...): "
                                f"not data a checkpoint holds; do not use files from an untrusted source")
            children.append((value, child, above + (id(value),)))
        stack.extend(reversed(children))
    return out
