"""The allowed import directions of docs/architecture.md, checked on every non-test module.

Each module of the project is parsed with ``ast`` (imports inside functions and ``TYPE_CHECKING`` blocks
included; relative imports resolved), every project import is matched against the rules of the room the
module lives in, and a wrong-way import fails the test with ``file:line: importer -> imported (rule)``.
The same imports make the module graph, which must have no circle (a strongly connected component of two
or more modules: an import inside a function closes a circle as well as one at the top, and a package's
``__init__`` re-exporting a submodule's names is an edge to that submodule), and no module may take a
private name (``_x``, not a dunder) from another module, by ``from m import _x`` or by ``m._x``.

``python -m tests.test_architecture`` prints the counts: circles, private cross-module imports and the
imports of project modules made inside functions.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("megatron_ds_suite", "data_pipeline", "training", "evaluation", "scripts", "benchmarks", "tests")
SCANNED = ("megatron_ds_suite", "data_pipeline", "training", "evaluation", "scripts", "benchmarks")

# The shared core: megatron_ds_suite/core plus the bundled-config lookup (standard library only).
CORE = ("megatron_ds_suite.core", "megatron_ds_suite.configs_lookup")
# Rooms, most specific first: (room, allowed project imports, forbidden project imports, the rule in words).
# A non-empty ``allowed`` forbids every other project import; otherwise only ``forbidden`` is.
RULES: list[tuple[str, tuple[str, ...], tuple[str, ...], str]] = [
    ("megatron_ds_suite.core", CORE, (), "the core imports none of the stages"),
    ("megatron_ds_suite.configs_lookup", CORE, (), "the core imports none of the stages"),
    ("training.parallel", ("training.parallel", *CORE), (),
     "training/parallel imports only torch, the standard library, the core and other parallel modules"),
    ("data_pipeline", ("data_pipeline", *CORE), (), "data_pipeline imports only the core"),
    ("training", ("training", *CORE), (), "training imports the core (not data_pipeline, not evaluation)"),
    ("evaluation", ("evaluation", "training", *CORE), (), "evaluation imports the core and training"),
    ("benchmarks", (), ("tests",), "benchmarks must not import tests (shared helpers: megatron_ds_suite.app.testing)"),
    ("scripts", (), ("tests", "benchmarks"), "scripts may import the stages, not tests or benchmarks"),
    ("megatron_ds_suite.app", (), ("tests", "benchmarks", "scripts"),
     "the application floor (main job, console, test helpers) may import every stage, not tests, benchmarks or "
     "scripts"),
    ("megatron_ds_suite", CORE, (), "the package root holds the core and the application floor, and imports only "
     "the core"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _package_of(path: Path) -> str:
    me = _module_name(path)
    return me if path.name == "__init__.py" else me.rpartition(".")[0]


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from <base> import ...`` (relative levels resolved against ``package``)."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


class Import(NamedTuple):
    line: int
    module: str  # the imported project module (a package stands for its ``__init__``)
    name: str | None  # the name taken from ``module`` by ``from module import name``, else None
    local: bool  # inside a function


def import_records(path: Path, source: str | None = None) -> list[Import]:
    """Every project import in ``path`` (or in ``source``, read as that file), in source order."""
    package = _package_of(path)
    text = path.read_text(encoding="utf-8") if source is None else source
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(child.lineno, a.name, None, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _from_base(child, package)
                for a in child.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    found.append(Import(child.lineno, sub, None, local) if _is_module(sub)
                                 else Import(child.lineno, base, a.name, local))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(text, str(path)), False)
    return [r for r in found if r.module.split(".")[0] in PROJECT]


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, imported project module) for every import in ``path`` (or in ``source``, read as that file)."""
    return [(r.line, r.module) for r in import_records(path, source)]


def room_of(module: str):
    for rule in RULES:
        if _under(module, rule[0]):
            return rule
    return None


def wrong_way(module: str, target: str) -> str | None:
    """The rule ``module`` importing ``target`` breaks, or None."""
    rule = room_of(module)
    if rule is None:
        return None
    _, allowed, forbidden, words = rule
    if allowed:
        return None if any(_under(target, a) for a in allowed) else words
    return words if any(_under(target, f) for f in forbidden) else None


def project_files() -> list[Path]:
    return [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py")) if "__pycache__" not in p.parts]


def violations() -> list[str]:
    bad = []
    for path in project_files():
        me = _module_name(path)
        for line, target in imports(path):
            words = wrong_way(me, target)
            if words:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {me} -> {target} ({words})")
    return bad


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_aliases(path: Path, tree: ast.AST) -> dict[str, str]:
    """Local name -> the project module an import binds it to (``import a.b`` binds ``a`` to ``a``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, _package_of(path))
            for a in node.names:
                if _is_module(f"{base}.{a.name}"):
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return {k: v for k, v in out.items() if v.split(".")[0] in PROJECT}


def private_imports(path: Path, source: str | None = None) -> list[str]:
    """``line: module.name`` for every private name ``path`` takes from another project module."""
    me = _module_name(path)
    text = path.read_text(encoding="utf-8") if source is None else source
    found = [(r.line, f"{r.module}.{r.name}") for r in import_records(path, text)
             if r.name and _private(r.name) and r.module != me]
    tree = ast.parse(text, str(path))
    aliases = _module_aliases(path, tree)
    for node in ast.walk(tree):  # m._x / a.b._x on a module bound by an import
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            continue
        module = aliases[value.id]
        for part in reversed(chain):
            if not _is_module(f"{module}.{part}"):
                break
            module = f"{module}.{part}"
        else:
            if module != me:
                found.append((node.lineno, f"{module}.{node.attr}"))
    return [f"{line}: {name}" for line, name in sorted(set(found))]


def import_graph(files: dict[str, list[Import]]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in it), over the modules of ``files``."""
    return {me: {r.module for r in recs if r.module in files and r.module != me} for me, recs in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def project_records() -> dict[str, list[Import]]:
    return {_module_name(p): import_records(p) for p in project_files()}


def counts() -> dict[str, int]:
    """The numbers issue 32 asks for, over the non-test modules."""
    recs = project_records()
    return {"circles": len(circles(import_graph(recs))),
            "private cross-module imports": sum(len(private_imports(p)) for p in project_files()),
            "function-local imports of project modules": sum(len({(r.line, r.module) for r in rs if r.local})
                                                             for rs in recs.values())}


def test_rules_cover_every_module():
    rooms = {_module_name(p) for top in SCANNED for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert rooms and all(room_of(m) is not None for m in rooms), sorted(m for m in rooms if room_of(m) is None)


def test_the_checker_sees_wrong_way_imports():
    """Absolute, ``from`` and relative imports are resolved and judged (else the main test could never fail)."""
    probe = ROOT / "training" / "parallel" / "probe.py"
    src = ("import torch\nimport training.config\nfrom data_pipeline import stages\n"
           "def f():\n    from ..runtime import device\n    from . import mappings\n")
    got = imports(probe, src)
    assert got == [(2, "training.config"), (3, "data_pipeline.stages"), (5, "training.runtime.device"),
                   (6, "training.parallel.mappings")]
    assert [t for _, t in got if wrong_way("training.parallel.probe", t)] == [
        "training.config", "data_pipeline.stages", "training.runtime.device"]
    assert wrong_way("megatron_ds_suite.core.corpus", "training.config")
    assert wrong_way("data_pipeline.stages", "training.data.gpt_dataset")
    assert not wrong_way("data_pipeline.stages", "megatron_ds_suite.core.indexed_dataset")
    assert wrong_way("training.trainer", "evaluation.race")
    assert wrong_way("evaluation.cli", "data_pipeline.config")
    assert not wrong_way("evaluation.cli", "training.metrics")
    assert wrong_way("benchmarks.bench_eval", "tests.distributed")
    assert not wrong_way("megatron_ds_suite.app.main_job.job", "data_pipeline.stages")
    assert wrong_way("megatron_ds_suite.core.config", "megatron_ds_suite.app.testing")


def test_imports_follow_the_allowed_directions():
    bad = violations()
    if bad:
        pytest.fail("wrong-way imports (docs/architecture.md):\n" + "\n".join(bad), pytrace=False)


def test_the_checker_sees_circles():
    """A circle closed by an import inside a function, and one through a package ``__init__`` re-export."""
    probe = ROOT / "training" / "tools" / "probe_a.py"
    a = import_records(probe, "import torch\nimport training.tools.probe_b as b\n")
    b = import_records(ROOT / "training" / "tools" / "probe_b.py",
                       "def f():\n    from .probe_a import x\n    return x\n")
    assert b == [Import(2, "training.tools.probe_a", "x", True)]
    files = {"training.tools.probe_a": a, "training.tools.probe_b": b, "training.tools.probe_c": []}
    assert circles(import_graph(files)) == [["training.tools.probe_a", "training.tools.probe_b"]]
    pkg = {"pkg": [Import(1, "pkg.sub", None, False)],  # pkg/__init__.py: from pkg.sub import helper
           "pkg.sub": [Import(3, "pkg.other", None, True)],
           "pkg.other": [Import(1, "pkg", "helper", False)],  # from pkg import helper (the re-export)
           "lone": [Import(1, "pkg", "helper", False)]}
    assert circles(import_graph(pkg)) == [["pkg", "pkg.other", "pkg.sub"]]
    assert circles(import_graph({"x": [Import(1, "y", None, False)], "y": []})) == []


def test_the_checker_sees_private_imports():
    """``from m import _x`` (absolute or relative, at the top or in a function) and ``m._x`` are reported;
    dunders, the module's own names and other objects' private attributes are not."""
    probe = ROOT / "data_pipeline" / "dedup" / "probe.py"
    src = ("from data_pipeline.dedup.hashing import _fmix64, __version__, units\n"
           "from data_pipeline.dedup import minhash\nimport data_pipeline.stages.filter as flt\n"
           "import data_pipeline.store\nfrom data_pipeline.dedup.probe import _mine\n"
           "def f(obj):\n    from .lsh import _band\n    obj._cache = minhash.Signer\n"
           "    return minhash._chunk_files, flt._tokenizer, data_pipeline.store._x, obj._y, minhash.__name__\n")
    assert private_imports(probe, src) == [
        "1: data_pipeline.dedup.hashing._fmix64", "7: data_pipeline.dedup.lsh._band",
        "9: data_pipeline.dedup.minhash._chunk_files", "9: data_pipeline.stages.filter._tokenizer",
        "9: data_pipeline.store._x"]


def test_no_import_circles():
    """No two project modules import each other, directly or through others (function-local imports and
    ``__init__`` re-exports count): move the piece both need into the lower module or a new small one."""
    found = circles(import_graph(project_records()))
    if found:
        pytest.fail("import circles (docs/architecture.md):\n" + "\n".join(" <-> ".join(c) for c in found),
                    pytrace=False)


def test_no_private_names_across_modules():
    """A helper another module needs gets a public name (or moves to the module that needs it)."""
    bad = [f"{p.relative_to(ROOT)}:{x}" for p in project_files() for x in private_imports(p)]
    if bad:
        pytest.fail("private names imported from another module:\n" + "\n".join(bad), pytrace=False)


def test_the_mfu_metric_loads_only_the_planners_accounting():
    """``training.metrics`` (the trainer's MFU) imports ``training.plan.accounting``, not the planner's CLI,
    report or time model: the ``training.plan`` package loads its submodules on first use."""
    import subprocess

    code = ("import sys, training.metrics; "
            "print(sorted(m for m in sys.modules if m.startswith('training.plan')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['training.plan', 'training.plan.accounting']", out


if __name__ == "__main__":  # python -m tests.test_architecture: the counts of issue 32
    for key, value in counts().items():
        print(f"{key}: {value}")
