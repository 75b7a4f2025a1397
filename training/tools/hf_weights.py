"""A transformers folder's weights, read by us and checked against the model its ``config.json`` builds.

``from_pretrained`` fills every tensor the files lack with random values (a ``config.json`` claiming more layers
than the weights hold, a deleted tensor, a ``model.safetensors.index.json`` that omits tensors) and drops the ones
the model does not have, with a warning at most. :mod:`training.tools.import_hf` reads the files here instead:

1. the weight files: ``model.safetensors``, else ``model.safetensors.index.json`` (its shards), else
   ``pytorch_model.bin`` (loaded with ``weights_only``, :mod:`training.safe_load`), else
   ``pytorch_model.bin.index.json``. A shard index must name files inside the folder, and map exactly the tensors
   its shards hold (a tensor it omits or names in the wrong shard is refused);
2. the names and shapes (from the safetensors headers, before any tensor is read) against the transformers model
   that ``config.json`` builds, made on the meta device (no memory): every parameter and persistent buffer
   required, tied copies (GPT-2's ``lm_head.weight``, BERT's decoder) optional, nothing else allowed but the
   buffers transformers itself skips (GPT-2's causal-mask ``attn.bias``, RoPE's ``inv_freq``, position ids).
   Names are taken as ``from_pretrained`` takes them: a folder saved from the base model (``h.0.…`` for
   ``transformer.h.0.…``) gets the model's prefix, BERT's legacy ``LayerNorm.gamma`` / ``.beta`` are
   ``.weight`` / ``.bias``;
3. the values: floating-point and finite (no NaN, no Inf).

Each refusal is one :class:`~training.tools.tensor_check.WeightsError` line naming the first few tensors of each
kind and counting them (:mod:`training.tools.tensor_check`).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from training import safe_load
from training.tools.hf_interop import ImportHFError
from training.tools.tensor_check import WeightsError, check_shapes, check_values, few

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# buffers older files hold that no transformers model of ours loads (GPT-2's masked_bias, Llama's per-layer inv_freq)
LEGACY_BUFFERS = (r"\.attn\.masked_bias$", r"rotary_emb\.inv_freq$")
LEGACY_NAMES = ((re.compile(r"LayerNorm\.gamma$"), "LayerNorm.weight"), (re.compile(r"LayerNorm\.beta$"), "LayerNorm.bias"))
FIX = "the folder does not hold this config.json's model; save the model again (save_pretrained) or fix config.json"


def damaged(path: Path, e: BaseException) -> ImportHFError:
    """The one line for a weights file its reader refuses (cut short, overwritten with junk)."""
    first = (str(e).splitlines() or [""])[0][:200]
    return ImportHFError(f"{path}: cannot load the weights ({type(e).__name__}: {first}): a damaged or incomplete "
                         f"weights file? download or save the model again")


def _index(folder: Path, name: str) -> dict[str, str]:
    """{tensor: shard file name} of a shard index, each shard a file inside ``folder``."""
    path = folder / name
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ImportHFError(f"{path} is not a readable shard index ({type(e).__name__}): save the model again") from None
    wmap = spec.get("weight_map") if isinstance(spec, dict) else None
    if not isinstance(wmap, dict) or not wmap or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in wmap.items()):
        raise ImportHFError(f"{path} has no weight_map of tensor names to shard files: save the model again")
    bad = sorted({v for v in wmap.values() if "/" in v or "\\" in v or v in ("", ".", "..")})
    if bad:
        raise ImportHFError(f"{path} names shard files outside its folder ({few(bad)}): refused")
    gone = sorted({v for v in wmap.values() if not (folder / v).is_file()})
    if gone:
        raise ImportHFError(f"{path} names {len(gone)} shard file(s) that are not there ({few(gone)}): download them")
    return wmap


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None, str]:
    """(weight files, the index's {tensor: file} or None, the index file name or '') in ``from_pretrained``'s order."""
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS], None, ""
    for name in (SAFETENSORS_INDEX, BIN_INDEX) if not (folder / BIN).is_file() else (SAFETENSORS_INDEX,):
        if (folder / name).is_file():
            wmap = _index(folder, name)
            return [folder / f for f in sorted(set(wmap.values()))], wmap, name
    if (folder / BIN).is_file():
        return [folder / BIN], None, ""
    raise ImportHFError(f"{folder} holds no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or {BIN_INDEX}): "
                        f"save the model with save_pretrained into it")


class _Source:
    """The tensors of the weight files by name: shapes first (safetensors headers), values on demand."""

    def __init__(self, files: list[Path]):
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.where: dict[str, Path] = {}
        self.loaded: dict[str, torch.Tensor] = {}
        for path in files:
            for name, shape in self._read(path).items():
                if name in self.where:
                    raise ImportHFError(f"tensor {name} is in both {self.where[name].name} and {path.name}: a damaged "
                                        f"download; download the model again")
                self.shapes[name], self.where[name] = shape, path

    def _read(self, path: Path) -> dict[str, tuple[int, ...]]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(path), framework="pt") as f:
                    return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...: a damaged file, one line
                raise damaged(path, e) from None
        try:
            state = safe_load.load(path)
        except safe_load.CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises whatever its reader raises
            raise damaged(path, e) from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
            raise ImportHFError(f"{path} is not a state dict of named tensors: save the model again")
        self.loaded.update(state)
        return {k: tuple(v.shape) for k, v in state.items()}

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out, by_file = {}, {}
        for n in names:
            if n in self.loaded:
                out[n] = self.loaded[n]
            else:
                by_file.setdefault(self.where[n], []).append(n)
        for path, ns in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for n in ns:
                        out[n] = f.get_tensor(n)
            except Exception as e:  # noqa: BLE001
                raise damaged(path, e) from None
        return {n: out[n] for n in names}


def expected_tensors(cls, hf_cfg) -> tuple[dict[str, tuple[int, ...]], set[str], list[str], str]:
    """(required {name: shape}, optional tied copies, patterns of names to skip, the base-model prefix) of
    transformers class ``cls`` built from ``hf_cfg`` on the meta device."""
    try:
        with torch.device("meta"):
            model = cls(hf_cfg)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build a model from: one line
        raise ImportHFError(f"config.json does not describe a {cls.__name__} transformers can build "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}): fix config.json") from None
    shapes, tied, seen = {}, set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(t.shape)
        if id(t) in seen:
            tied.add(name)
        seen.add(id(t))
    persistent = set(shapes)
    skip = [re.escape(n) + "$" for n, _ in model.named_buffers() if n not in persistent]
    skip += list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []) + list(LEGACY_BUFFERS)
    return shapes, tied, skip, getattr(model, "base_model_prefix", "") or ""


def _our_name(name: str, expected: Mapping, prefix: str) -> str:
    """A file's tensor name as ``from_pretrained`` reads it: legacy LayerNorm names, the base-model prefix added."""
    for pattern, repl in LEGACY_NAMES:
        name = pattern.sub(repl, name)
    if name not in expected and prefix and f"{prefix}.{name}" in expected:
        return f"{prefix}.{name}"
    return name


def _layer_hint(found: Mapping, expected: Mapping) -> str:
    """', config.json says 4 layers but the weights hold 3' when the layer counts differ."""
    def layers(names) -> set[int]:
        return {int(m.group(1)) for m in (re.search(r"\.(?:h|layers?)\.(\d+)\.", n) for n in names) if m}

    have, want = layers(found), layers(expected)
    if want and have != want and have <= want:
        return f" (config.json says {len(want)} layers but the weights hold {len(have)})"
    return ""


def read_checked(folder: Path, cls, hf_cfg) -> dict[str, torch.Tensor]:
    """``folder``'s tensors {transformers name: tensor}, checked against ``cls(hf_cfg)`` (module docstring)."""
    files, wmap, index_name = weight_files(folder)
    src = _Source(files)
    if wmap is not None:
        omitted = [n for n in src.shapes if n not in wmap]
        wrong = [n for n, f in wmap.items() if src.where.get(n) is None or src.where[n].name != f]
        if omitted or wrong:
            parts = ([f"omits {len(omitted)} tensor(s) its shards hold ({few(omitted)})"] if omitted else []) + \
                    ([f"maps {len(wrong)} tensor(s) to a shard that does not hold them ({few(wrong)})"] if wrong else [])
            raise WeightsError(f"{folder / index_name} {' and '.join(parts)}: the index does not describe its shards; "
                               f"download or save the model again")
    expected, tied, skip, prefix = expected_tensors(cls, hf_cfg)
    names = {}
    for name in src.shapes:
        ours = _our_name(name, expected, prefix)
        if ours in expected or not any(re.search(p, ours) for p in skip):
            names[ours] = name
    found = {ours: src.shapes[name] for ours, name in names.items()}
    check_shapes(found, expected, str(folder), FIX, optional=tied, hint=_layer_hint(found, expected))
    tensors = src.tensors(list(names.values()))
    out = {ours: tensors[name] for ours, name in names.items()}
    check_values(out, str(folder))
    return out
