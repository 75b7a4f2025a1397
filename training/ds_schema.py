"""Check a ``deepspeed:`` pass-through section against DeepSpeed's own config schema.

DeepSpeed ignores a top-level key it does not know (``wall_clock_breakdwn: true`` is accepted and does
nothing), so a typo there would be silent. The known keys are not written down here: they are derived from
the installed DeepSpeed at run time, by letting ``DeepSpeedConfig`` parse the section through a dict that
records every key DeepSpeed looks up (:class:`_Recorder`; a feature this DeepSpeed removed is refused with
DeepSpeed's own reason). A key no lookup asked for is unknown and refused in
one line naming the closest key DeepSpeed does read (difflib). Sections DeepSpeed reads whole (iterated,
copied or unpacked, e.g. into its pydantic models such as ``DeepSpeedZeroConfig``) are left to DeepSpeed's
own validation: its ``DeepSpeedConfigModel`` forbids extra fields, and that error is turned into the same
kind of line, with the closest field of the model.
"""
from __future__ import annotations

import difflib
import logging
import typing
from collections.abc import KeysView
from typing import Any

from megatron_ds_suite.core.errors import ConfigError

_OPEN = "<read whole>"


class _Keys(KeysView):
    def __contains__(self, key):
        self._mapping.saw(key)
        return dict.__contains__(self._mapping, key)

    def __iter__(self):
        self._mapping.read_whole()
        return dict.__iter__(self._mapping)


class _Recorder(dict):
    """A dict (nested dicts too) that records, per path, the keys looked up and whether it was read whole."""

    def __init__(self, data: dict, path: tuple = (), log: dict | None = None, defaults: dict | None = None):
        self.path, self.log = path, ({} if log is None else log)
        self.defaults = {} if defaults is None else defaults  # (path + (key,)) -> the default DeepSpeed passed
        super().__init__({k: _Recorder(v, path + (k,), self.log, self.defaults) if isinstance(v, dict) else v
                          for k, v in data.items()})

    def saw(self, key) -> None:
        self.log.setdefault(self.path, set()).add(key)

    def read_whole(self) -> None:
        self.log.setdefault(self.path, set()).add(_OPEN)

    def get(self, key, default=None):
        self.saw(key)
        if default is not None:
            self.defaults.setdefault(self.path + (key,), default)
        return dict.get(self, key, default)

    def __getitem__(self, key):
        self.saw(key)
        return dict.__getitem__(self, key)

    def __contains__(self, key):
        self.saw(key)
        return dict.__contains__(self, key)

    def keys(self):
        return _Keys(self)

    def __iter__(self):  # also makes ``**d`` go through keys()/__getitem__ (no C fast path)
        self.read_whole()
        return dict.__iter__(self)

    def items(self):
        self.read_whole()
        return dict.items(self)

    def values(self):
        self.read_whole()
        return dict.values(self)

    def __copy__(self):
        if self.path:  # a section copied is passed on whole (e.g. to a DeepSpeed feature's own parser)
            self.read_whole()
        # DeepSpeedConfig copies the top level first ("so that the user json is unmodified"): still recorded
        clone = _Recorder.__new__(_Recorder)
        dict.update(clone, dict.items(self))
        clone.path, clone.log, clone.defaults = self.path, self.log, self.defaults
        return clone


def _lookup(d: dict, path: tuple):
    """``d[path[0]][path[1]]...``, None where the path is not there."""
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _type_mismatch(value, default) -> str | None:
    """The type DeepSpeed expects for a scalar it reads with ``default`` (``get_scalar_param``), when ``value`` is
    not of it: DeepSpeed does no type check there, so ``steps_per_print: often`` failed deep inside the engine."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, (int, float)):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None


def _closest(word: str, known) -> str:
    match = difflib.get_close_matches(word, sorted(str(k) for k in known), n=1, cutoff=0.0)
    return f"did you mean {match[0]!r}?" if match else "DeepSpeed reads no key there"


def _leaves(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out += _leaves(v, prefix + (k,)) if isinstance(v, dict) and v else [prefix + (k,)]
    return out


def _model_fields(title: str, loc: tuple) -> list[str]:
    """Field names (and aliases) of the DeepSpeed pydantic model ``title``, descended along ``loc``."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from pydantic import BaseModel

    todo, model = [DeepSpeedConfigModel], None
    while todo and model is None:
        cls = todo.pop()
        model = cls if cls.__name__ == title else None
        todo += cls.__subclasses__()
    for name in loc:
        if model is None:
            return []
        field = next((f for n, f in model.model_fields.items() if name in (n, f.alias)), None)
        if field is None:
            return []
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        model = next((t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if model is None:
        return []
    return sorted({n for n in model.model_fields} | {f.alias for f in model.model_fields.values() if f.alias})


def _refuse_validation_error(err, section: dict) -> None:
    first = err.errors()[0]
    loc = tuple(str(x) for x in first["loc"])
    path = next((p for p in _leaves(section) + [p[:-1] for p in _leaves(section)]
                 if len(p) >= len(loc) and tuple(map(str, p[-len(loc):])) == loc), loc) if loc else ()
    key = "deepspeed." + ".".join(map(str, path))
    if first["type"] == "extra_forbidden":
        hint = _closest(loc[-1], _model_fields(err.title, loc[:-1]))
        raise ConfigError(f"{key} is not a DeepSpeed option (DeepSpeed's {err.title} has no field {loc[-1]!r}): "
                          f"{hint}") from None
    raise ConfigError(f"{key}: {first['msg']} (DeepSpeed's {err.title})") from None


def check_schema(section: dict[str, Any], reference: dict[str, Any] | None = None) -> None:
    """Refuse a key of ``section`` (the ``deepspeed:`` pass-through) that the installed DeepSpeed does not read, or a
    scalar of another type than the default DeepSpeed reads it with (where that default is None: than the value
    ``reference``, the DeepSpeed config this project derives, has there)."""
    if not section:
        return
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    class OneRank:  # parse as one process: the batch sizes below add up whatever the job's world size
        def get_data_parallel_world_size(self):
            return 1

    batch = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    rec = _Recorder({**section, **batch})
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)  # DeepSpeed warns again when the engine parses the real config
    try:
        DeepSpeedConfig(rec, mpu=OneRank())
    except ValidationError as e:
        _refuse_validation_error(e, section)
    except (DeepSpeedConfigError, AssertionError) as e:  # e.g. a feature this DeepSpeed removed, with its reason
        raise ConfigError(f"deepspeed: {' '.join(str(e).split())}") from None
    finally:
        ds_logger.setLevel(level)
    for leaf in _leaves(section):
        default = rec.defaults.get(leaf, _lookup(reference or {}, leaf))
        want = _type_mismatch(_lookup(section, leaf), default)
        if want is not None:
            raise ConfigError(f"deepspeed.{'.'.join(map(str, leaf))}={_lookup(section, leaf)!r}: DeepSpeed reads {want} "
                              f"there (e.g. {default!r})")
        for depth in range(len(leaf)):
            seen = rec.log.get(leaf[:depth])
            if not seen or _OPEN in seen:
                break  # read whole (or handed over as it is): DeepSpeed's own validation decides
            if leaf[depth] not in seen:
                key = "deepspeed." + ".".join(map(str, leaf[:depth + 1]))
                where = "at the top level" if depth == 0 else "in deepspeed." + ".".join(map(str, leaf[:depth]))
                raise ConfigError(f"{key} is not a DeepSpeed option (DeepSpeed reads no such key {where}): "
                                  f"{_closest(leaf[depth], seen)}")


#: DeepSpeed keys every run writes with the same value (the ``deepspeed:`` section may replace them); also the
#: reference type of a key DeepSpeed reads with a default of None (``training.ds_schema.check_schema``)
DS_FIXED: dict[str, Any] = {
    "steps_per_print": 10**9,  # we log ourselves, one line per step
    "zero_allow_untested_optimizer": True,  # our client optimizer is torch.optim.AdamW
    # DeepSpeed's throughput timer synchronises the device twice per micro-batch; we time steps ourselves
    # (re-enable with deepspeed: {timers: {throughput: {enabled: true}}})
    "timers": {"throughput": {"enabled": False}},
}
