"""The text side of the strict config loader: YAML files and ``a.b=value`` overrides -> plain dicts.

:mod:`megatron_ds_suite.core.config` turns what this module reads into typed dataclasses; every config of the
suite (corpus builder, training run, main job) is read through both, so they all accept and refuse the same things:

* YAML with YAML 1.2 numbers: ``1e-4`` and ``7e-1`` are floats (PyYAML implements YAML 1.1, where a
  float needs a dot and a signed exponent, so ``safe_load`` returns ``'7e-1'`` as a string). A key
  written twice in one mapping is refused instead of silently keeping the last value.
* Overrides ``a.b=value``: the value is a YAML scalar or flow collection (``x=[1, 2]``,
  ``x={a: 1}``); a number in the path indexes a list (``sources.0.limit=5``); a mapping value merges
  into the mapping already there. Precedence: overrides > file > dataclass defaults.
* Depth: a YAML file or override value nested deeper than :data:`MAX_DEPTH` levels is refused in one line (deeper
  than Python's stack, PyYAML itself would fail with a ``RecursionError``).

Every problem raises :class:`~megatron_ds_suite.core.errors.ConfigError` with one line.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from megatron_ds_suite.core.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# YAML with YAML 1.2 floats
# --------------------------------------------------------------------------------------------------
#: floats with an exponent as YAML 1.2 writes them (no dot needed, optional exponent sign); the forms
#: without exponent are already floats for PyYAML's YAML 1.1 resolver
FLOAT_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class StrictYAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads YAML 1.2 exponent floats and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


StrictYAMLLoader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT_EXPONENT, list("-+0123456789."))


MAX_DEPTH = 100
"""Mappings and lists nested deeper than this in a config are refused (a config of this suite nests 4 deep)."""


def parse_yaml(text: str, where: str) -> Any:
    """YAML ``text`` -> Python objects (:class:`StrictYAMLLoader`); ``where`` names it in the error."""
    try:
        data = yaml.load(text, Loader=StrictYAMLLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        if isinstance(e, yaml.MarkedYAMLError) and e.problem:
            mark = e.problem_mark
            detail = e.problem + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")
        else:
            detail = str(e).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML: {detail}") from None
    except RecursionError:  # PyYAML's composer and constructor recurse once per level
        raise ConfigError(f"{where} is nested deeper than Python's stack allows (a config nests a few levels; "
                          f"at most {MAX_DEPTH})") from None
    if _depth(data) > MAX_DEPTH:
        raise ConfigError(f"{where} is nested deeper than {MAX_DEPTH} levels of mappings/lists (a config nests a few "
                          f"levels)")
    return data


def _depth(data: Any) -> int:
    """Nesting depth of mappings and lists (a scalar is 0), counted without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            items = list(node.values())
        elif isinstance(node, list):
            items = node
        else:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # past the limit the answer is known
            stack.extend((x, level + 1) for x in items)
    return deepest


def read_yaml(path: str | Path, what: str = "config file", hint: str = "") -> dict[str, Any]:
    """Read a YAML file that holds a mapping (an empty file is ``{}``).

    ``what`` names the file in errors (``"config file"``, ``"main-job config"``); ``hint`` is added to
    the "does not exist" message (e.g. where the examples are)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist{hint}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {p} cannot be read: {e}") from None
    data = parse_yaml(text, f"{what} {p}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p} must be a mapping of keys at top level, got {kind_of(data)}")
    return data


# --------------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------------
def parse_value(raw: str, item: str = "") -> Any:
    """An override's value: a YAML scalar or flow collection; the empty string stays ``""``."""
    if raw == "":
        return ""
    return parse_yaml(raw, f"override {item!r}: the value")


def parse_override(item: str, example: str = "section.key=value") -> tuple[list[str], Any]:
    """``"a.b.0=1e-4"`` -> (``["a", "b", "0"]``, ``0.0001``)."""
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override {item!r} must look like key.subkey=value (e.g. {example})")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key part (write key.subkey=value)")
    return parts, parse_value(raw, item)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None,
                    example: str = "section.key=value") -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b=value`` override applied in order.

    Missing (or null) sections on the way are created; a number indexes an existing list item; a
    mapping value merges into an existing mapping, anything else replaces the value. Whether the
    keys exist is checked later, by
    :func:`megatron_ds_suite.core.config.build_dataclass`, with the full list of valid keys."""
    out = copy.deepcopy(data) if data else {}
    for item in overrides or []:
        parts, value = parse_override(item, example)
        node: Any = out
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not p.isdigit() or int(p) >= len(node):
                    raise ConfigError(f"override {item!r}: {p!r} is not an index of {'.'.join(parts[:i])}, "
                                      f"a list of {len(node)} item(s)")
                key: Any = int(p)
            elif isinstance(node, dict):
                key = p
                if not last and node.get(p) is None:
                    node[p] = {}
            else:
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:i])} is {kind_of(node)} {shorten(node)}, "
                                  f"not a section with keys")
            if last:
                old = node[key] if isinstance(node, list) else node.get(key)
                node[key] = merge_dicts(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
            else:
                node = node[key]
    return out


def overrides_to_dict(overrides: list[str] | None, example: str = "section.key=value") -> dict[str, Any]:
    """``["train.iters=50", "parallel.tensor=2"]`` -> ``{"train": {"iters": 50}, "parallel": {"tensor": 2}}``."""
    return apply_overrides({}, overrides, example)


def merge_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mappings merged recursively (neither argument is modified)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --------------------------------------------------------------------------------------------------
# A value as an error line names it
# --------------------------------------------------------------------------------------------------
def kind_of(value: Any) -> str:
    """``"a mapping"``, ``"a list"``, ``"null"`` or the type's name: what a config value is, for an error line."""
    return {dict: "a mapping", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


def shorten(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (``...`` at the end) for an error line."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."
