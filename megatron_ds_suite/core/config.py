"""The strict config loader's typed side: plain dicts (YAML and overrides, read by
:mod:`megatron_ds_suite.core.config_yaml`) -> typed dataclasses, with ranges of numbers and freezing.

Every config of the suite (corpus builder, training run, main job) is a tree of dataclasses read by
this module, so they all accept and refuse the same things:

* Strict checks: an unknown key names the valid keys at that level (and the closest one); a value of
  the wrong type names the key, the expected type and the value. ``int`` is accepted where a
  ``float`` is expected; ``bool`` is never an ``int``; ``None`` (YAML ``null``) only where the
  annotation allows it; ``Literal[...]`` values are checked; nested dataclasses, ``list[T]`` and
  ``dict[str, T]`` are checked item by item.
* Numbers: NaN and infinities are refused in every ``float`` field (a field that means them opts in with
  ``Annotated[float, Range(finite=False)]``); a field annotated ``Annotated[float, Range(gt=0)]`` (or
  :data:`Positive`, :data:`NonNegative`, :data:`AtLeastOne`, :data:`Fraction`) has its range checked here, so
  every config states its ranges where its keys are declared instead of in a list of ``if``s.
* Freezing: :func:`freeze` settles a config once its derived values are known; a later write raises
  :class:`FrozenConfigError`.

Every problem raises :class:`~megatron_ds_suite.core.errors.ConfigError` with one line; the command
line tools print it as ``config error: ...`` (or ``error: ...``) and exit with code 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Annotated, Any, Literal, TypeVar

from megatron_ds_suite.core.config_yaml import FLOAT_EXPONENT, kind_of, shorten
from megatron_ds_suite.core.errors import ConfigError

T = TypeVar("T")

# --------------------------------------------------------------------------------------------------
# Ranges of numbers
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Range:
    """The values a number field accepts, declared on its annotation: ``eps: Annotated[float, Range(gt=0)] = 1e-8``;
    :func:`build_dataclass` checks them (one line: ``config error: optimizer.eps must be > 0, got -1.0``).
    ``finite=False`` lets a float field hold NaN or an infinity (refused everywhere else)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    finite: bool = True

    def describe(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in [0, 1]"``, ``"in (0, 1)"``."""
        low = (self.gt, "(") if self.gt is not None else (self.ge, "[") if self.ge is not None else None
        high = (self.lt, ")") if self.lt is not None else (self.le, "]") if self.le is not None else None
        if low and high:
            return f"in {low[1]}{_num(low[0])}, {_num(high[0])}{high[1]}"
        if low:
            return f"{'>' if low[1] == '(' else '>='} {_num(low[0])}"
        if high:
            return f"{'<' if high[1] == ')' else '<='} {_num(high[0])}"
        return "a number"

    def check(self, value: float, where: str) -> None:
        ok = ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
              and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))
        if not ok:
            raise ConfigError(f"{where} must be {self.describe()}, got {value!r}")


def check_ranges(obj: Any, where: str = "") -> None:
    """The finiteness and :class:`Range` checks of :func:`build_dataclass`, on a config dataclass ``obj`` (and the
    dataclasses inside it) that was built or changed in Python (an importer's mapped model config, a saved run's
    config): the same one-line ``ConfigError``. Types are not rechecked."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        _check_number(getattr(obj, f.name), hints.get(f.name, Any), f"{where}{f.name}")


def _check_number(value: Any, tp: Any, where: str) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        check_ranges(value, f"{where}.")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                check_ranges(item, f"{where}[{i}].")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        arms = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (
            typing.Union, types.UnionType) else [tp]
        for arm in arms:
            rng = next((x for x in typing.get_args(arm)[1:] if isinstance(x, Range)), None) if typing.get_origin(
                arm) is Annotated else None
            if _bare(arm) is float and (rng is None or rng.finite) and not math.isfinite(value):
                raise ConfigError(f"{where}: {value} is not a finite number ({where} must be a number, not nan or "
                                  f"infinity)")
            if rng is not None:
                rng.check(value, where)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


Positive = Range(gt=0)
"""``Annotated[float, Positive]``: > 0 (a learning rate, an epsilon, a timeout)."""
NonNegative = Range(ge=0)
"""``Annotated[int, NonNegative]``: >= 0 (a count where 0 means none or off, a weight decay)."""
AtLeastOne = Range(ge=1)
"""``Annotated[int, AtLeastOne]``: >= 1 (a size, a batch, a number of steps that must happen)."""
Fraction = Range(ge=0, le=1)
"""``Annotated[float, Fraction]``: in [0, 1] (a probability)."""


# --------------------------------------------------------------------------------------------------
# dict -> dataclass
# --------------------------------------------------------------------------------------------------
def build_dataclass(cls: type[T], data: Any, where: str = "") -> T:
    """``data`` (a mapping, or None for all defaults) -> dataclass ``cls``, strictly checked.

    ``where`` is the dotted path of ``data`` inside the whole config ("" at the top), used in messages."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {kind_of(data)} {shorten(data)}")
    hints = typing.get_type_hints(cls, include_extras=True)  # Annotated[..., Range(...)] kept
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{did_you_mean}; valid keys here: "
                              f"{', '.join(sorted(names))}")
    for f in fields:
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{f.name} is required (no default)")
    kwargs = {k: coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def coerce(value: Any, tp: Any, where: str, finite: bool = True) -> Any:  # noqa: C901
    """Check ``value`` against the annotation ``tp``; returns it (ints as floats for ``float``). A ``float`` must be
    finite unless ``finite`` is false (``Annotated[float, Range(finite=False)]``)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        rng = next((x for x in extras if isinstance(x, Range)), None)
        value = coerce(value, base, where, finite=rng.finite if rng else finite)
        if rng is not None and value is not None:
            rng.check(value, where)
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(where, tp, value)
        (item,) = typing.get_args(tp) or (Any,)
        return [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(where, tp, value)
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _type_error(where, tp, value)
        return build_dataclass(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(where, tp, value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(where, tp, value)
        return value
    if tp is float:
        if isinstance(value, str) and FLOAT_EXPONENT.match(value):
            value = float(value.replace("_", ""))  # ``7e-1`` read by a plain YAML 1.1 parser (yaml.safe_load)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(where, tp, value)
        if finite and not math.isfinite(value):
            raise ConfigError(f"{where}: {value} is not a finite number ({where} must be a number, not nan or "
                              f"infinity)")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(where, tp, value)
        return value
    raise ConfigError(f"{where}: unsupported annotation {_type_name(tp)} in the config dataclass")


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    arms = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
        if len(arms) < len(typing.get_args(tp)):
            return None
        raise _type_error(where, tp, value)
    for arm in arms:
        try:
            return coerce(value, arm, where)
        except ConfigError as e:
            if _same_shape(value, arm):  # the right kind of value with a bad item inside or out of range: say which
                raise e from None
    raise _type_error(where, tp, value)


def _bare(tp: Any) -> Any:
    """``Annotated[T, ...]`` -> ``T``."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _same_shape(value: Any, tp: Any) -> bool:
    tp = _bare(tp)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True  # a number, refused for its value (nan, out of range): not for its type
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return True
    origin = typing.get_origin(tp) or tp
    return (origin is list and isinstance(value, list)) or (
        (origin is dict or dataclasses.is_dataclass(tp)) and isinstance(value, dict))


def _type_error(where: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{where}: expected {_describe(tp)}, got {shorten(value)} ({where} must be {_type_name(tp)})")


_DESCRIBE = {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _describe(tp: Any) -> str:
    tp = _bare(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping of keys"
    return _DESCRIBE.get(tp, _type_name(tp))


def _type_name(tp: Any) -> str:
    tp = _bare(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', origin)}[{args}]"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a section"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")



# --------------------------------------------------------------------------------------------------
# Freezing: a config is settled once the run's derived values are known
# --------------------------------------------------------------------------------------------------
class FrozenConfigError(ConfigError):
    """A write to a config after :func:`freeze` (a bug in the caller, reported as one line)."""


class Freezable:
    """Mixin for config dataclasses: after :func:`freeze`, setting a field raises FrozenConfigError."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise FrozenConfigError(f"the config is frozen once the run layout is derived: {type(self).__name__}."
                                    f"{name} cannot change now; set it in the YAML or as an override")
        object.__setattr__(self, name, value)


def freeze(cfg: Any) -> Any:
    """Freeze ``cfg`` and every nested :class:`Freezable` dataclass in place; returns ``cfg``.

    A ``copy.deepcopy`` (or pickle) of a frozen config is frozen too; to change values build a new one
    from ``to_dict()`` (``config_from_dict``)."""
    if isinstance(cfg, Freezable):
        for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
            freeze(getattr(cfg, f.name))
        object.__setattr__(cfg, "_frozen", True)
    return cfg


def is_frozen(cfg: Any) -> bool:
    return bool(getattr(cfg, "_frozen", False))
