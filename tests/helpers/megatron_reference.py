"""Independent ports of Megatron-LM's reference code, shared by the data, blending and fidelity tests: the
blending order (plain Python, and Megatron's own ``helpers.cpp`` compiled from a Megatron-LM checkout or
mirror), the epoch count and ``build_sample_idx`` of its GPT dataset, and its ``AnnealingLR`` schedule; and
handles on Megatron-Core's own data code from the installed ``megatron-core`` wheel (its blending helpers, its
``GPTDataset`` over its ``IndexedDataset``)."""
from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from training.config import OptimizerConfig


# --- blending ----------------------------------------------------------------------------------------------------
def reference_blend(raw_weights: list[float], size: int) -> tuple[list[int], list[int]]:
    """Megatron's pipeline written out plainly, one position at a time, in numpy float64 scalars:
    get_datasets_weights_and_num_samples normalises (running float sum), BlendableDataset normalises again
    (numpy.sum over a float64 array), build_blending_indices picks, for position p, the first dataset with the
    strictly largest ``w[i] * max(p, 1) - current_samples[i]``."""
    s = 0.0
    for w in raw_weights:
        s = s + w
    first = [w / s for w in raw_weights]
    weights = np.array(first, dtype=np.float64)
    weights = weights / np.sum(weights)
    current = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for p in range(size):
        p_double = np.float64(max(p, 1))
        max_index = 0
        max_error = weights[0] * p_double - np.float64(current[0])
        for i in range(1, len(weights)):
            error = weights[i] * p_double - np.float64(current[i])
            if error > max_error:
                max_error = error
                max_index = i
        dataset_index.append(max_index)
        dataset_sample_index.append(current[max_index])
        current[max_index] += 1
    return dataset_index, dataset_sample_index


MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
REVISIONS = {  # the 2021 reference tree and HEAD of ../shared/reference/megatron.md
    "2021-90e0a0dd08": ("90e0a0dd08", "megatron/data/helpers.cpp"),
    "HEAD-d98e8a64dd": ("d98e8a64dd", "megatron/core/datasets/helpers.cpp"),
}
SHIM = """
#include <algorithm>
#include <cstdint>
#include <iostream>
namespace py {
template <typename T> struct array_t {
  T *data;
  struct view { T *p; T &operator[](int64_t i) const { return p[i]; } T &operator()(int64_t i) const { return p[i]; } };
  template <int N> view mutable_unchecked() { return view{data}; }
  template <int N> view unchecked() const { return view{data}; }
};
}
using namespace std;
"""


def megatron_source(rev: str, path: str) -> str:
    """helpers.cpp of ``rev``: from a checkout named by MEGATRON_LM_DIR (its own revision), else the mirror."""
    if os.environ.get("MEGATRON_LM_DIR"):
        f = Path(os.environ["MEGATRON_LM_DIR"]) / path
        if not f.is_file():
            pytest.skip(f"{f} absent")
        return f.read_text()
    if not MIRROR.is_dir() or shutil.which("git") is None:
        pytest.skip("Megatron-LM source absent (set MEGATRON_LM_DIR to a checkout)")
    r = subprocess.run(["git", "-C", str(MIRROR), "show", f"{rev}:{path}"], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"{rev}:{path} not in the mirror")
    return r.stdout


def compile_megatron_blend(source: str, build: Path):
    """Megatron's ``build_blending_indices`` verbatim, with a few-line stand-in for pybind11's array views,
    compiled with Megatron's Makefile flags and called through ctypes."""
    start = source.index("void build_blending_indices(")
    body_open = source.index("{", start)
    depth, i = 0, body_open
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            break
        i += 1
    function = source[start:i + 1]
    index_type = re.search(r"array_t<(\w+)>\s*&\s*dataset_index", function).group(1)
    wrapper = f"""
extern "C" void blend(void *di, int64_t *dsi, double *w, int32_t k, int64_t size) {{
  py::array_t<{index_type}> a{{({index_type} *)di}};
  py::array_t<int64_t> b{{dsi}};
  py::array_t<double> c{{w}};
  build_blending_indices(a, b, c, k, size, false);
}}
"""
    (build / "blend.cpp").write_text(SHIM + function + wrapper)
    lib = build / "blend.so"
    subprocess.run([shutil.which("g++") or "g++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC",
                    str(build / "blend.cpp"), "-o", str(lib)], check=True, capture_output=True)
    dll = ctypes.CDLL(str(lib))
    dll.blend.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64]
    return dll.blend, {"uint8_t": np.uint8, "int16_t": np.int16}[index_type]


# --- GPT dataset index maps ---------------------------------------------------------------------------------
def megatron_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Megatron's ``_num_epochs`` loop."""
    e, total = 0, 0
    while True:
        e += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return e


def cpp_build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                         tokens_per_epoch: int) -> np.ndarray:
    """Line-by-line port of Megatron's helpers.cpp ``build_sample_idx``."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_id = doc_idx[doc_idx_index]
            doc_length = int(sizes[doc_id]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return out


# --- learning-rate schedule ---------------------------------------------------------------------------------
class MegatronAnnealingLR:
    """Port of Megatron's AnnealingLR: built with ``step(0)``, stepped after every applied update."""

    def __init__(self, max_lr, min_lr, warmup_steps, decay_steps, decay_style):
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.decay_style = warmup_steps, decay_steps, decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * float(self.num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        ratio = float(self.num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        assert 0.0 <= ratio <= 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self.lr = self.get_lr()


def megatron_lrs(cfg: OptimizerConfig, iters: int) -> list[float]:
    """The rate each of ``iters`` updates runs at in Megatron's loop (optimizer.step, then scheduler.step)."""
    decay = cfg.decay_iters if cfg.decay_iters is not None else iters
    sched = MegatronAnnealingLR(cfg.lr, cfg.min_lr, cfg.warmup_iters, decay, cfg.decay_style)
    out = []
    for _ in range(iters):
        out.append(sched.lr)
        sched.step()
    return out


# --- Megatron-Core (the megatron-core wheel of the test extra) ---------------------------------------------
def megatron_core_datasets_dir() -> Path:
    """megatron/core/datasets of the installed megatron-core; skip when it is not installed."""
    pytest.importorskip("megatron.core", reason="megatron-core (the test extra) is not installed")
    import megatron.core.datasets as mcd

    return Path(mcd.__file__).parent


def megatron_core_blend(how: str, build: Path):
    """Megatron-Core's own ``build_blending_indices`` as ``blend(weights, size) -> (dataset_index, sample_index)``.

    ``how="prebuilt"``: the wheel's compiled ``helpers_cpp`` through ``megatron.core.datasets.helpers``, called as
    ``BlendedDataset._build_indices`` calls it (the weights as a Python list); ``how="source"``: the wheel's own
    ``helpers.cpp`` compiled here with g++ (:func:`compile_megatron_blend`; Megatron-Core's ``compile_helpers``
    runs a Makefile the wheel does not ship)."""
    src = megatron_core_datasets_dir() / "helpers.cpp"
    if how == "prebuilt":
        try:
            from megatron.core.datasets import helpers
        except ImportError as e:
            pytest.skip(f"megatron-core's compiled helpers do not import ({e})")

        def blend(weights, size):
            di, dsi = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(di, dsi, [float(w) for w in weights], len(weights), size, False)
            return di, dsi
        return blend
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build megatron-core's helpers.cpp")
    if not src.is_file():
        pytest.skip(f"{src} is not in the megatron-core wheel")
    raw, index_dtype = compile_megatron_blend(src.read_text(), build)

    def blend(weights, size):
        w = np.ascontiguousarray(weights, dtype=np.float64)
        di, dsi = np.zeros(size, dtype=index_dtype), np.zeros(size, dtype=np.int64)
        raw(di.ctypes.data, dsi.ctypes.data, w.ctypes.data, len(w), size)
        return di, dsi
    return blend


class McoreTokenizer:
    """What Megatron-Core's ``GPTDatasetConfig`` reads of a tokenizer (vocabulary size, EOD and pad ids)."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, vocab_size  # a pad id no token has
        self.unique_identifiers = {"class": "McoreTokenizer", "vocab_size": vocab_size, "eod": eod}


def megatron_core_gpt_dataset(prefix: Path, documents: np.ndarray, num_samples: int, seq_length: int, seed: int,
                              split: str, cache: Path | None, vocab_size: int, eod: int):
    """Megatron-Core's own ``GPTDataset`` (its ``IndexedDataset`` reading ``prefix``) over the item ids
    ``documents`` of split ``split`` ("train", "valid" or "test"), its index maps cached under ``cache``."""
    megatron_core_datasets_dir()
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=None, split="1,0,0",
                           path_to_cache=None if cache is None else str(cache),
                           tokenizer=McoreTokenizer(vocab_size, eod), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False)
    return GPTDataset(IndexedDataset(str(prefix)), str(prefix), np.asarray(documents, dtype=np.int32), num_samples,
                      getattr(Split, split), cfg)


def megatron_core_builder_blend(prefixes: list[Path], weights: list[float], split: str, sizes: tuple[int, int, int],
                                seq_length: int, seed: int, vocab_size: int, eod: int) -> list:
    """Megatron-Core's own ``BlendedMegatronDatasetBuilder`` (``--data-path w0 p0 w1 p1 ... --split SPLIT``) over our
    prefixes: its train/valid/test ``BlendedDataset`` (None where its split matrix has none), built in memory."""
    megatron_core_datasets_dir()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, split=split, path_to_cache=None,
                           blend=([str(p) for p in prefixes], [float(w) for w in weights]),
                           tokenizer=McoreTokenizer(vocab_size, eod), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, cfg).build()
