"""Input readers: every source yields :class:`RawRecord` s in a fixed, deterministic order.

A reader never raises on bad input: a record it cannot turn into text comes out with ``text=None``
and a ``reason`` (one of :data:`REJECT_REASONS`), so the caller can count it and write an example to
the rejects file. Memory per record is bounded by ``max_doc_bytes`` (an over-long JSON line is
skipped chunk by chunk, never held whole).

Formats: jsonl (plain or ``.gz``; blank lines are not records), plain text (one document per file,
or one per blank-line-separated block), parquet (streamed in record batches), Hugging Face
``datasets`` (by Hub name, streamed, or a local ``save_to_disk`` folder / loadable path), and the
embedded default corpus (:mod:`data_pipeline.default_corpus`).
"""
from __future__ import annotations

import functools
import glob as globmod
import gzip
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from data_pipeline.config import BuildConfig, ConfigError, SourceConfig
from data_pipeline.default_corpus import iter_default_corpus
from megatron_ds_suite.core.hf_datasets import check_no_script, load_hf_dataset

log = logging.getLogger(__name__)

#: Reasons a record is rejected before cleaning (``empty`` is decided after cleaning).
REJECT_REASONS = ("bad_json", "missing_field", "non_string_field", "invalid_utf8", "too_large",
                  "unreadable_file", "empty")

#: A jsonl record nested deeper than this is rejected as ``bad_json``: far beyond any real document's
#: metadata, well inside the interpreter's recursion limit, so whether a line parses never depends on
#: the stack it is parsed on, and nothing downstream (ids in documents.jsonl, pickling to workers) recurses
#: without bound.
MAX_JSON_DEPTH = 100

_EXTS = {
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "text": (".txt", ".text", ".md"),
    "parquet": (".parquet",),
}
#: compression suffixes a jsonl/text file may carry (case-insensitive); .zst needs the zstandard package
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")


def _format_of(name: str, kind: str) -> str | None:
    """``name``'s compression suffix ("" for none) if it is a ``kind`` file, else None (case-insensitive)."""
    low = name.lower()
    comp = next((c for c in _COMPRESSION if low.endswith(c)), "")
    if comp and kind == "parquet":
        return None
    return comp if low[:len(low) - len(comp)].endswith(_EXTS.get(kind, ())) else None


def _open_bytes(path: Path) -> IO[bytes]:
    """``path`` opened for binary reading through its compression (by suffix, case-insensitive)."""
    low = path.name.lower()
    if low.endswith(".gz"):
        return gzip.open(path, "rb")
    if low.endswith(".bz2"):
        import bz2

        return bz2.open(path, "rb")
    if low.endswith(".xz"):
        import lzma

        return lzma.open(path, "rb")
    if low.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise OSError(f"{path.name} is zstd-compressed: install the zstandard package "
                          f"(pip install zstandard) or decompress it (zstd -d)") from None
        return zstandard.open(path, "rb")
    return open(path, "rb")


@dataclass
class RawRecord:
    src: str  # where it came from: "path:line", "path#block", "hf:name[i]", "python-doc:..."
    text: str | None  # None when rejected
    reason: str | None = None
    detail: str = ""  # for the rejects file: error message and/or a prefix of the raw input
    uid: Any = None  # the user's own id (``id_field``), kept verbatim for documents.jsonl's "id"
    line: bytes | None = None  # a jsonl line not parsed yet (``lazy`` reading): :meth:`resolve` parses it
    fields: tuple[str, str | None, int] | None = None  # (text_field, id_field, max_bytes) for :meth:`resolve`

    def resolve(self) -> RawRecord:
        """This record, its jsonl line parsed (in the ingest worker: the reader then only cuts lines)."""
        if self.line is None or self.fields is None:
            return self
        return parse_jsonl_line(self.src, self.line, *self.fields)


def _snippet(b: bytes | str, n: int = 200) -> str:
    if isinstance(b, bytes):
        b = b[:n].decode("utf-8", errors="backslashreplace")
    return b[:n]


def expand_paths(cfg: BuildConfig, src: SourceConfig, report: bool = False) -> list[Path]:
    """Files of a source: the file itself, every matching file under a directory (sorted, recursive),
    or the sorted matches of a glob. ``report``: warn about the directory's files that are not read; only the
    reader asks (:func:`iter_source`, once per build): the stage fingerprints list the files too, dozens of times
    a build, and warned each time (63 identical warnings in a 5-stage build of 8 shards)."""
    p = cfg.resolve(src.path or "")
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        keep = [f for f in files if _format_of(f.name, src.type) is not None]
        other = [f for f in files if _format_of(f.name, src.type) is None]
        if other and report:  # never silently: say which files of the folder are not read
            comp = "" if src.type == "parquet" else f", optionally {'/'.join(_COMPRESSION)}"
            log.warning("source %s %s: %d file(s) not read (not %s%s, any case): %s%s", src.type, src.path,
                        len(other), "/".join(_EXTS[src.type]), comp,
                        ", ".join(str(f.relative_to(p)) for f in other[:5]), " ..." if len(other) > 5 else "")
        return keep
    return sorted(Path(x) for x in globmod.glob(str(p), recursive=True) if Path(x).is_file())


def _read_lines_bounded(f: IO[bytes], max_bytes: int) -> Iterator[tuple[bytes | None, int]]:
    """Yield (line, size) per line; line is None when longer than max_bytes (size = bytes seen)."""
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        if len(line) > max_bytes and not line.endswith(b"\n"):
            size = len(line)
            while True:  # skip the rest of the over-long line without holding it
                chunk = f.readline(1 << 20)
                size += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield None, size
        else:
            yield line, len(line)


def _check_text(src: str, text: Any, field: str, max_bytes: int) -> RawRecord:
    if text is None:
        return RawRecord(src, None, "missing_field", f"field {field!r} missing or null")
    if not isinstance(text, str):
        return RawRecord(src, None, "non_string_field", f"field {field!r} is {type(text).__name__}: "
                         + _snippet(repr(text)))
    try:
        n = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates from JSON escapes such as "\ud800"
        return RawRecord(src, None, "invalid_utf8", f"{e.reason} at {e.start}: " + _snippet(repr(text)))
    if n > max_bytes:
        return RawRecord(src, None, "too_large", f"{n} bytes > max_doc_bytes={max_bytes}")
    return RawRecord(src, text)


def nested_deeper_than(obj: Any, limit: int, text: str = "") -> bool:
    """Whether parsed JSON ``obj`` nests lists/objects more than ``limit`` deep (without recursion). ``text``,
    the line it came from, skips the walk when it holds too few brackets to nest that deep."""
    if text and text.count("[") + text.count("{") <= limit:
        return False
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_jsonl_line(sid: str, line: bytes, text_field: str, id_field: str | None, max_bytes: int) -> RawRecord:
    """One non-blank jsonl line (at most ``max_bytes``) → its record, or a rejected one with the reason."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRecord(sid, None, "invalid_utf8", f"{e.reason} at byte {e.start}: " + _snippet(line))
    obj, too_deep = None, False
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        return RawRecord(sid, None, "bad_json", f"{e.msg} (col {e.colno}): " + _snippet(s))
    except RecursionError:  # nested deeper than the interpreter's stack: 2 KB of brackets suffice
        too_deep = True
    except ValueError as e:  # an integer of more than 4,300 digits: Python's int-from-string limit
        return RawRecord(sid, None, "bad_json", f"{str(e).split(':')[0]}: " + _snippet(s))
    if too_deep or nested_deeper_than(obj, MAX_JSON_DEPTH, s):
        return RawRecord(sid, None, "bad_json", f"nested deeper than {MAX_JSON_DEPTH} levels: " + _snippet(s))
    if not isinstance(obj, dict):
        return RawRecord(sid, None, "bad_json", f"not a JSON object ({type(obj).__name__}): " + _snippet(s))
    rec = _check_text(sid, obj.get(text_field), text_field, max_bytes)
    if id_field and obj.get(id_field) is not None:
        rec.src = f"{sid}#{obj[id_field]}"
        rec.uid = obj[id_field]
    return rec


def read_jsonl(path: Path, src: SourceConfig, max_bytes: int, lazy: bool = False) -> Iterator[RawRecord]:
    """Records of a jsonl file; with ``lazy`` each non-blank line comes unparsed (``RawRecord.line``), for
    the ingest worker to parse (:meth:`RawRecord.resolve`: the same record), so reading the input is only
    cutting lines and does not bound the build's throughput to one process's JSON parsing."""
    try:
        f = _open_bytes(path)
    except OSError as e:
        yield RawRecord(str(path), None, "unreadable_file", f"{type(e).__name__}: {e}")
        return
    lineno = 0
    fields = (src.text_field, src.id_field, max_bytes)
    try:
        with f:
            for line, size in _read_lines_bounded(f, max_bytes):
                lineno += 1
                sid = f"{path}:{lineno}"
                if lineno == 1 and line is not None and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]  # a UTF-8 byte-order mark is not part of the first record
                if line is None:
                    yield RawRecord(sid, None, "too_large", f"line of {size} bytes > max_doc_bytes={max_bytes}")
                    continue
                if not line.strip():
                    continue  # a blank line is not a record
                yield RawRecord(sid, None, line=line, fields=fields) if lazy else parse_jsonl_line(sid, line, *fields)
    except (OSError, EOFError, gzip.BadGzipFile, ValueError) as e:  # truncated/corrupt archive, I/O errors
        yield RawRecord(f"{path}:{lineno + 1}", None, "unreadable_file", f"{type(e).__name__}: {e}")


def _decode(sid: str, data: bytes, max_bytes: int) -> RawRecord:
    if len(data) > max_bytes:
        return RawRecord(sid, None, "too_large", f"{len(data)} bytes > max_doc_bytes={max_bytes}")
    try:
        return RawRecord(sid, data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return RawRecord(sid, None, "invalid_utf8", f"{e.reason} at byte {e.start}: "
                         + _snippet(data[max(0, e.start - 40):e.start + 40]))


def read_text(path: Path, src: SourceConfig, max_bytes: int) -> Iterator[RawRecord]:  # noqa: C901
    try:
        if src.text_mode == "file":
            size = path.stat().st_size
            if size > max_bytes and not _format_of(path.name, "text"):
                yield RawRecord(str(path), None, "too_large", f"{size} bytes > max_doc_bytes={max_bytes}")
                return
            with _open_bytes(path) as f:
                yield _decode(str(path), f.read(max_bytes + 1), max_bytes)
            return
        block: list[bytes] = []
        size, start, nblock = 0, 0, 0
        with _open_bytes(path) as f:
            for lineno, (line, n) in enumerate(_read_lines_bounded(f, max_bytes), 1):
                blank = line is not None and not line.strip()
                if blank:
                    if size:
                        nblock += 1
                        yield (_decode(f"{path}#{nblock}@{start}", b"".join(block), max_bytes) if block
                               else RawRecord(f"{path}#{nblock}@{start}", None, "too_large",
                                              f"block of {size} bytes > max_doc_bytes={max_bytes}"))
                    block, size = [], 0
                    continue
                if not size:
                    start = lineno
                size += n
                if line is None or size > max_bytes:
                    block = []  # too large: stop holding it, keep counting until the block ends
                elif size <= max_bytes:
                    block.append(line)
            if size:
                nblock += 1
                yield (_decode(f"{path}#{nblock}@{start}", b"".join(block), max_bytes) if block
                       else RawRecord(f"{path}#{nblock}@{start}", None, "too_large",
                                      f"block of {size} bytes > max_doc_bytes={max_bytes}"))
    except (OSError, EOFError, ValueError) as e:
        yield RawRecord(str(path), None, "unreadable_file", f"{type(e).__name__}: {e}")


def read_parquet(path: Path, src: SourceConfig, max_bytes: int) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if src.text_field not in names:
            for row in range(pf.metadata.num_rows):
                yield RawRecord(f"{path}[{row}]", None, "missing_field",
                                f"column {src.text_field!r} not in {names}")
            return
        cols = [src.text_field] + ([src.id_field] if src.id_field and src.id_field in names else [])
        is_str = pa.types.is_string(pf.schema_arrow.field(src.text_field).type) or \
            pa.types.is_large_string(pf.schema_arrow.field(src.text_field).type)
        for batch in pf.iter_batches(batch_size=1024, columns=cols):
            texts = batch.column(0).to_pylist()
            ids = batch.column(1).to_pylist() if len(cols) > 1 else [None] * len(texts)
            for t, i in zip(texts, ids):
                sid = f"{path}[{row}]" + (f"#{i}" if i is not None else "")
                row += 1
                if t is not None and not is_str:
                    yield RawRecord(sid, None, "non_string_field", f"column type "
                                    f"{pf.schema_arrow.field(src.text_field).type}: " + _snippet(repr(t)))
                else:
                    rec = _check_text(sid, t, src.text_field, max_bytes)
                    rec.uid = i
                    yield rec
    except (OSError, pa.ArrowException) as e:
        yield RawRecord(f"{path}[{row}]", None, "unreadable_file", f"{type(e).__name__}: {e}")


def open_hf(cfg: BuildConfig, src: SourceConfig) -> tuple[Iterator[dict], str]:
    """Open a Hugging Face source: (its examples, the name its record ids use), the first example already
    fetched, so a source that cannot be loaded (a folder that is not a dataset, a damaged ``save_to_disk``,
    a Hub name that cannot be reached, a missing split) fails here, as one ConfigError line, not as one
    counted record. A local ``save_to_disk`` folder is memory-mapped (``load_from_disk``); anything else
    goes to ``load_dataset(..., streaming=True)`` (Hub name or local data folder; a loading script is
    refused, never run: megatron_ds_suite.core.hf_datasets)."""
    import datasets

    path = src.path or ""
    local = cfg.resolve(path)
    check_no_script(local)  # a loading script is code: refused in one line (SuiteError), never run
    try:
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[src.hf_split]
            name = str(local)
        else:
            target = str(local) if local.exists() else path
            ds = load_hf_dataset(target, src.hf_name, split=src.hf_split, streaming=True)
            name = path
        it = iter(ds)
        first = list(itertools.islice(it, 1))
    except Exception as e:  # whatever datasets raises: the source cannot be read
        where = f"{local}" if local.exists() else f"{path!r}"
        raise ConfigError(f"source hf {where} cannot be loaded as a Hugging Face dataset (split "
                          f"{src.hf_split!r}{f', config {src.hf_name!r}' if src.hf_name else ''}): "
                          f"{type(e).__name__}: {' '.join(str(e).split())[:300]} - give a datasets.save_to_disk "
                          f"folder, a folder of data files or a reachable Hub name, or remove the source") from None
    return itertools.chain(first, it), name


def check_sources(cfg: BuildConfig) -> None:
    """Open every ``hf`` source once before any work starts, so one that cannot be loaded stops the build
    with one line (ConfigError, exit 2) before a shard is written."""
    for src in cfg.sources:
        if src.type == "hf":
            open_hf(cfg, src)


def read_hf(cfg: BuildConfig, src: SourceConfig, max_bytes: int) -> Iterator[RawRecord]:
    """Hugging Face datasets (:func:`open_hf`); a failure after the source opened (a stream cut midway) is
    one counted ``unreadable_file`` record."""
    it, name = open_hf(cfg, src)
    row = 0
    try:
        for ex in it:
            sid = f"hf:{name}[{row}]"
            if src.id_field and ex.get(src.id_field) is not None:
                sid += f"#{ex[src.id_field]}"
            row += 1
            rec = _check_text(sid, ex.get(src.text_field), src.text_field, max_bytes)
            if src.id_field:
                rec.uid = ex.get(src.id_field)
            yield rec
    except Exception as e:  # network cut, corrupt arrow midway: one counted record, not a crash
        yield RawRecord(f"hf:{src.path or ''}[{row}]", None, "unreadable_file", f"{type(e).__name__}: {e}")


def read_default(max_bytes: int) -> Iterator[RawRecord]:
    for sid, text in iter_default_corpus():
        yield _check_text(sid, text, "text", max_bytes)


def iter_source(cfg: BuildConfig, src: SourceConfig, lazy: bool = False) -> Iterator[RawRecord]:
    """A source's records in order; ``lazy``: jsonl lines come unparsed (see :func:`read_jsonl`)."""
    max_bytes = cfg.clean.max_doc_bytes
    if src.type == "default":
        gen = read_default(max_bytes)
    elif src.type == "hf":
        gen = read_hf(cfg, src, max_bytes)
    else:
        reader = {"jsonl": functools.partial(read_jsonl, lazy=lazy), "text": read_text,
                  "parquet": read_parquet}[src.type]
        paths = expand_paths(cfg, src, report=True)
        if not paths:
            raise ConfigError(f"source {src.type} {src.path!r}: no {src.type} files there "
                              f"({'/'.join(_EXTS[src.type])}, any case): fix its path or remove the source")
        gen = (rec for p in paths for rec in reader(p, src, max_bytes))
    n = 0
    for n, rec in enumerate(gen, 1):
        if src.limit is not None and n > src.limit:
            return
        yield rec
    if n == 0 and src.limit != 0:
        raise ConfigError(f"source {src.type} {src.path or ''!r} yielded no records (empty files or an empty "
                          f"dataset): fix its path or remove the source")


def iter_records(cfg: BuildConfig, lazy: bool = False) -> Iterator[RawRecord]:
    """All sources, in config order; the position in this stream is a record's input index."""
    for src in cfg.sources:
        yield from iter_source(cfg, src, lazy)


def input_fingerprint(cfg: BuildConfig) -> list[Any]:
    """Sizes and mtimes of local inputs, so a changed input invalidates the finished ingest stage."""
    out: list[Any] = []
    for s in cfg.sources:
        if s.type == "default":
            out.append(["default", sys.version])
            continue
        if s.type == "hf" and not cfg.resolve(s.path or "").exists():
            out.append(["hf", s.path, s.hf_name, s.hf_split])
            continue
        files = expand_paths(cfg, s) if s.type != "hf" else [cfg.resolve(s.path or "")]
        for p in files:
            try:
                st = os.stat(p)
                out.append([str(p), st.st_size, int(st.st_mtime)])
            except OSError:
                out.append([str(p), None])
    return out
