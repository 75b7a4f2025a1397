"""Embedded default corpus: real English text that ships inside Python itself.

Nothing is downloaded and nothing is shipped by the project: the documents are

1. the 79 or so help topics of ``pydoc_data.topics`` (the text behind ``help('FOR')`` etc., generated
   from the Python reference manual), one document per topic; and
2. the docstrings of a fixed, curated list of standard-library modules (their module docstring and
   the ``__doc__`` of every public class, function and method defined in them), one document each.

Determinism: the module list, the attribute walk (``sorted(vars(obj))``) and the text are fixed for a
given CPython build, so the same interpreter yields the same documents in the same order on every
run (modules a build lacks, e.g. ``sqlite3`` without libsqlite, are skipped in place). Different
CPython versions ship different docstrings, so the exact count varies by version; the ``src`` field
of each record names its origin.

Natural near-duplicates occur: the pure-Python twins of C modules (``_pyio`` / ``io``,
``_pydecimal`` / ``decimal``, ``_collections_abc`` / ``collections.abc``), the ``json`` and
``pickle`` ``dump``/``dumps``/``load``/``loads`` families, and methods that copy a base class's text.

Modules are imported, so the list excludes anything with import-time side effects (``this``,
``antigravity``, ``idlelib``, ``tkinter``, ``turtle``).

Isolation: the documents are read in a fresh interpreter (``python -I -S`` on this file: no site-packages,
no environment), never in the calling process, whose imports can change the standard library it would
read (``import ray`` pulls in grpc, which replaces ``inspect.isgenerator``: one document fewer). So the
corpus is a function of the CPython build alone, in a local build and in a Ray worker alike.
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import subprocess
import sys
import warnings
from collections.abc import Iterator

log = logging.getLogger(__name__)

#: Curated, side-effect-free standard-library modules, in a fixed order.
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bdb", "binascii", "bisect", "bz2",
    "calendar", "cmd", "codecs", "collections", "collections.abc", "_collections_abc", "concurrent.futures",
    "configparser", "contextlib", "contextvars", "copy", "csv", "dataclasses", "datetime", "decimal",
    "_pydecimal", "difflib", "dis", "doctest", "email.message", "email.utils", "enum", "filecmp",
    "fnmatch", "fractions", "ftplib", "functools", "gc", "getopt", "gettext", "glob", "graphlib",
    "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client", "http.cookies",
    "http.server", "imaplib", "importlib", "importlib.metadata", "inspect", "io", "_pyio",
    "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "logging.handlers",
    "lzma", "mailbox", "math", "mimetypes", "multiprocessing", "numbers", "operator", "optparse",
    "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib",
    "pprint", "profile", "pstats", "queue", "quopri", "random", "re", "reprlib", "runpy", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket",
    "socketserver", "sqlite3", "ssl", "statistics", "string", "struct", "subprocess", "symtable",
    "sys", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "tomllib", "trace", "traceback", "tracemalloc", "types", "typing", "unicodedata", "unittest",
    "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
    "xml.dom.minidom", "xml.etree.ElementTree", "xml.sax", "zipfile", "zipimport", "zlib", "zoneinfo",
)

#: Docstrings shorter than this many characters are not emitted (they could never reach the 128-token
#: length filter; ~4 characters per token).
MIN_DOC_CHARS = 400


def _docstring_documents(modname: str) -> Iterator[tuple[str, str]]:  # noqa: C901
    try:
        mod = importlib.import_module(modname)
    except Exception as exc:  # a build without the module: skipped, deterministically per build
        log.debug("default corpus: skipping %s (%s)", modname, exc)
        return
    seen: set[int] = set()

    def emit(qualname: str, obj: object) -> Iterator[tuple[str, str]]:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and len(doc) >= MIN_DOC_CHARS:
            yield f"python-doc:{qualname}", f"{qualname}\n\n{inspect.cleandoc(doc)}"

    yield from emit(modname, mod)
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = vars(mod)[name]
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) not in (modname, mod.__name__) or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield from emit(f"{modname}.{name}", obj)
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                if attr.startswith("_") and attr != "__init__":
                    continue
                member = vars(obj)[attr]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isroutine(member) or isinstance(member, property):
                    yield from emit(f"{modname}.{name}.{attr}", member)


def _documents() -> Iterator[tuple[str, str]]:
    """The documents, read in this process (run by :func:`iter_default_corpus` in a fresh interpreter)."""
    from pydoc_data.topics import topics  # here: ~0.8 MB of text that only this fresh interpreter needs

    for key in sorted(topics):
        yield f"pydoc-topic:{key}", topics[key]
    for modname in STDLIB_MODULES:
        with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            docs = list(_docstring_documents(modname))
        yield from docs


def iter_default_corpus() -> Iterator[tuple[str, str]]:
    """Yield ``(source_id, text)`` for every document of the embedded corpus, in a fixed order (read in a fresh
    ``python -I -S``, see the module docstring)."""
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", __file__], capture_output=True, check=True, timeout=600)
    except subprocess.CalledProcessError as e:
        tail = e.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"reading the built-in corpus in a fresh {sys.executable} failed: {tail[0]}") from None
    for line in proc.stdout.decode("utf-8").splitlines():
        sid, text = json.loads(line)
        yield sid, text


if __name__ == "__main__":  # the fresh interpreter of iter_default_corpus: one JSON line per document
    out = sys.stdout
    for sid, text in _documents():
        out.write(json.dumps([sid, text]) + "\n")
