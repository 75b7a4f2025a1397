"""The allowed import directions of docs/architecture.md, checked on every non-test module.

Each module of the project is parsed with ``ast`` (imports inside functions and ``TYPE_CHECKING`` blocks
included; relative imports resolved), every project import is matched against the rules of the room the
module lives in, and a wrong-way import fails the test with ``file:line: importer -> imported (rule)``.
The same imports make the module graph, which must have no circle (a strongly connected component of two
or more modules: an import inside a function closes a circle as well as one at the top, and a package's
``__init__`` re-exporting a submodule's names is an edge to that submodule), and no module may take a
private name (``_x``, not a dunder) from another module, by ``from m import _x`` or by ``m._x``.
Inside ``training/`` the layers of the drawing hold (``TRAINING_LAYERS``: parallel < models < data/tasks <
trainer < tools/entry points): no module imports a layer above its own, directly or through a module of no
layer. Every folder at the top of the repository is one this file knows (``TOP_LEVEL``), and the tests sit
in their tiers (``tests/unit``, ``tests/parallel``, ``tests/e2e``; helpers in ``tests/helpers``, tools pytest
does not collect in ``TEST_TOOLS``), none importing another test module. No production module (``PRODUCTION``) is
longer than ``MAX_MODULE_LINES`` lines.

``python -m tests.unit.test_architecture`` prints the counts: circles, private cross-module imports and the
imports of project modules made inside functions.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    ("training.models", ("training.models", "training.parallel", *CORE), (),
     "training/models reads its shape from training.models.config: it imports no run config (training.config, "
     "training.ds_json, training.resolve), only other model modules, training/parallel and the core"),
    ("data_pipeline", ("data_pipeline", *CORE), (), "data_pipeline imports only the core"),
    ("training.pretrain", ("training", "evaluation.lm_eval_train", *CORE), (),
     "the pretraining entry point imports training, the core and, for eval.tasks, evaluation.lm_eval_train only"),
    ("training", ("training", *CORE), (), "training imports the core (not data_pipeline, not evaluation)"),
    ("evaluation", ("evaluation", "training", *CORE), (), "evaluation imports the core and training"),
    ("benchmarks", (), ("tests",), "benchmarks must not import tests (the shared spawner: training.runtime.spawn)"),
    ("scripts", (), ("tests", "benchmarks"), "scripts may import the stages, not tests or benchmarks"),
    ("megatron_ds_suite.app", (), ("tests", "benchmarks", "scripts"),
     "the application floor (main job, console) may import every stage, not tests, benchmarks or "
     "scripts"),
    ("megatron_ds_suite", CORE, (), "the package root holds the core and the application floor, and imports only "
     "the core"),
]

# The layers inside training/ (docs/architecture.md), lowest first: (layer, the modules it holds, by prefix).
# A module may import training modules of its own layer or a lower one, never of a higher one. A training
# module in no layer (config, layout, runtime, checkpoint, plan, metrics, ...) stands as high as the highest
# layer it imports, directly or through other such modules, so no layer reaches upwards through it.
TRAINING_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("parallel", ("training.parallel",)),
    ("models", ("training.models",)),
    ("data/tasks", ("training.data", "training.tasks")),
    ("trainer", ("training.trainer",)),
    ("tools/entry points", ("training.tools", "training.pretrain", "training.finetune_race")),
]

# Every folder at the top of the repository and what it holds; a new one is added here, to SCANNED and RULES
# when it holds Python, and to docs/architecture.md's table. Hidden folders and .gitignore'd ones are not looked at.
TOP_LEVEL = {
    "megatron_ds_suite": "the shared core, the main job, the console commands",
    "data_pipeline": "the corpus-building stage",
    "training": "the training stage",
    "evaluation": "the evaluation stage",
    "scripts": "shell entry points and tools run as modules",
    "benchmarks": "speed and memory measurements",
    "tests": "pytest on CPU, in tiers",
    "configs": "YAML configs (no Python)",
    "docs": "documentation (no Python)",
}
# The test tiers (README, "Run the tests"): test modules live only in these folders of tests/.
TEST_TIERS = {
    "unit": "starts no process: no gloo ranks, no child Python, no launcher",
    "parallel": "2-4 gloo ranks (run_distributed) or child processes working beside the test",
    "e2e": "commands run end to end: python -m entry points, the deepspeed launcher, the main job, scripts",
}
TEST_HELPERS = "helpers"  # tests/helpers: shared helper modules (fixtures: tests/conftest.py)
# Tools under tests/ that pytest does not collect (no test_*.py in them), each run as a module.
TEST_TOOLS = {"hostile": "the hostile-user probe, python -m tests.hostile (docs/errors.md)"}
# What a unit-tier test file may not contain: each starts a process (README's test section).
UNIT_FORBIDDEN = ("run_distributed", "free_port", "sys.executable", "multiprocessing", "Popen")


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


# No production module grows past this many lines (issue 39): a module that does is split by concern, each new
# module one job with a docstring saying what it owns. benchmarks/ and tests/ are not production.
MAX_MODULE_LINES = 450
PRODUCTION = ("data_pipeline", "training", "evaluation", "megatron_ds_suite", "scripts")


def oversized_modules(root: Path = ROOT, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` for every ``.py`` under the production folders of ``root`` longer than ``limit`` lines."""
    found = []
    for top in PRODUCTION:
        for p in sorted((root / top).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            n = len(p.read_text(encoding="utf-8").splitlines())
            if n > limit:
                found.append(f"{p.relative_to(root).as_posix()}: {n} lines")
    return found


def test_no_production_module_over_the_line_limit():
    bad = oversized_modules()
    assert not bad, (f"modules over {MAX_MODULE_LINES} lines (split them by concern, docs/architecture.md):\n"
                     + "\n".join(bad))


def test_the_checker_sees_oversized_modules(tmp_path):
    (tmp_path / "training" / "tools").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "training" / "tools" / "big.py").write_text("x = 1\n" * 451)
    (tmp_path / "training" / "small.py").write_text("x = 1\n" * 450)
    (tmp_path / "benchmarks" / "big.py").write_text("x = 1\n" * 900)
    assert oversized_modules(tmp_path) == ["training/tools/big.py: 451 lines"]


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
    assert wrong_way("training.models.gpt2", "training.config")  # the model's shape is training.models.config
    assert not wrong_way("training.models.gpt2", "training.models.config")
    assert wrong_way("data_pipeline.stages", "training.data.gpt_dataset")
    assert not wrong_way("data_pipeline.stages", "megatron_ds_suite.core.indexed_dataset")
    assert wrong_way("training.trainer", "evaluation.race")
    assert wrong_way("evaluation.cli", "data_pipeline.config")
    assert not wrong_way("evaluation.cli", "training.metrics")
    assert wrong_way("benchmarks.bench_eval", "tests.helpers.distributed")
    assert not wrong_way("megatron_ds_suite.app.main_job.job", "data_pipeline.stages")
    assert wrong_way("megatron_ds_suite.core.config", "megatron_ds_suite.app.console")


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


# --- the layers inside training/ ------------------------------------------------------------------------------
def training_layer(module: str) -> int | None:
    """The index in TRAINING_LAYERS of the layer holding ``module`` (None: a training module of no layer)."""
    for k, (_, prefixes) in enumerate(TRAINING_LAYERS):
        if any(_under(module, p) for p in prefixes):
            return k
    return None


def layer_heights(files: dict[str, list[Import]]) -> dict[str, tuple[int, list[str]]]:
    """Training module -> (the layer it stands at, -1 below all; the chain of layerless modules lifting it).

    A module of a layer stands at that layer; a layerless one at the highest height among the training modules
    it imports (a circle, reported by its own test, is cut where it closes)."""
    graph = {m: {t for t in targets if _under(t, "training")} for m, targets in import_graph(files).items()}
    heights: dict[str, tuple[int, list[str]]] = {}
    busy: set[str] = set()

    def height(m: str) -> tuple[int, list[str]]:
        if m in heights:
            return heights[m]
        own = training_layer(m)
        if own is not None:
            heights[m] = (own, [m])
            return heights[m]
        busy.add(m)
        best: tuple[int, list[str]] = (-1, [m])
        for t in sorted(graph.get(m, ())):
            if t not in busy:
                h, chain = height(t)
                if h > best[0]:
                    best = (h, [m, *chain])
        busy.discard(m)
        heights[m] = best
        return best

    for m in sorted(graph):
        if _under(m, "training"):
            height(m)
    return heights


def layer_violations(files: dict[str, list[Import]]) -> list[str]:
    """``module:line: module -> imported (rule)`` for every import of a training layer above the importer's."""
    heights = layer_heights(files)
    bad = []
    for me, recs in sorted(files.items()):
        own = training_layer(me)
        if own is None:
            continue
        for r in recs:
            if r.module not in heights or r.module == me:
                continue
            h, chain = heights[r.module]
            if h > own:
                through = f" through {' -> '.join(chain)}" if len(chain) > 1 else ""
                bad.append(f"{me}:{r.line}: {me} -> {r.module} (layer '{TRAINING_LAYERS[own][0]}' may not import "
                           f"layer '{TRAINING_LAYERS[h][0]}'{through})")
    return bad


def test_every_training_layer_names_existing_modules():
    """A renamed or moved module leaves no stale entry: each prefix of TRAINING_LAYERS is a module or package."""
    stale = [p for _, prefixes in TRAINING_LAYERS for p in prefixes if not _is_module(p)]
    assert not stale, f"TRAINING_LAYERS names modules that do not exist (update it and docs/architecture.md): {stale}"


def test_training_layers_are_kept():
    bad = layer_violations({m: r for m, r in project_records().items() if _under(m, "training")})
    if bad:
        pytest.fail("imports up the layers inside training/ (docs/architecture.md: "
                    + " < ".join(name for name, _ in TRAINING_LAYERS) + "):\n" + "\n".join(bad), pytrace=False)


def test_the_checker_sees_layer_violations():
    """Planted in a copy of the real import records: a model importing the trainer from inside a function, a
    data module reaching the tools through a new module of no layer, and parallel importing models."""
    files = {m: list(r) for m, r in project_records().items() if _under(m, "training")}
    assert "training.models.gpt2" in files and "training.data.loader" in files and "training.tools.reshard" in files
    before = set(layer_violations(files))  # empty unless the real code breaks a layer (its own test says so)
    files["training.models.gpt2"].append(Import(900, "training.trainer", "Trainer", True))
    files["training.probe_helper"] = [Import(3, "training.tools.reshard", None, True), Import(4, "training.config", None, False)]
    files["training.data.loader"].append(Import(901, "training.probe_helper", None, False))
    files["training.parallel.layers"].append(Import(902, "training.models.blocks", None, False))
    assert [v for v in layer_violations(files) if v not in before] == [
        "training.data.loader:901: training.data.loader -> training.probe_helper (layer 'data/tasks' may not import "
        "layer 'tools/entry points' through training.probe_helper -> training.tools.reshard)",
        "training.models.gpt2:900: training.models.gpt2 -> training.trainer (layer 'models' may not import "
        "layer 'trainer')",
        "training.parallel.layers:902: training.parallel.layers -> training.models.blocks (layer 'parallel' may "
        "not import layer 'models')",
    ]
    # a layer may import its own layer and the ones below; a layerless module importing nothing stands at -1
    assert layer_heights({"training.config": [], "training.tasks.gpt": [Import(1, "training.data.loader", None, False)],
                          "training.data.loader": [Import(1, "training.config", None, False)]}) == {
        "training.config": (-1, ["training.config"]), "training.data.loader": (2, ["training.data.loader"]),
        "training.tasks.gpt": (2, ["training.tasks.gpt"])}



# --- the folders at the top and the test tiers -----------------------------------------------------------------
def _ignored_folders(root: Path) -> list[str]:
    """The folder patterns of ``root``/.gitignore (``name/`` lines), as fnmatch patterns."""
    gi = root / ".gitignore"
    lines = gi.read_text(encoding="utf-8").splitlines() if gi.is_file() else []
    return [line.strip().strip("/") for line in lines if line.strip().endswith("/") and not line.startswith("#")]


def unknown_top_level(root: Path) -> list[str]:
    """Folders at the top of ``root`` that TOP_LEVEL does not know (hidden and .gitignore'd ones left out)."""
    from fnmatch import fnmatch

    ignored = _ignored_folders(root) + ["__pycache__"]
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and not any(fnmatch(p.name, pat) for pat in ignored) and p.name not in TOP_LEVEL)


def misplaced_tests(tests: Path) -> list[str]:
    """What sits in the wrong place under ``tests``: a module directly in it other than conftest/__init__, a
    test module outside the tier folders, a folder that is no tier and not the helpers; each with where it goes."""
    tiers = ", ".join(f"tests/{t}/ ({what})" for t, what in TEST_TIERS.items())
    bad = []
    for p in sorted(tests.iterdir()):
        if p.is_file() and p.suffix == ".py" and p.name not in ("conftest.py", "__init__.py"):
            where = f"one of {tiers}" if p.name.startswith("test_") else f"tests/{TEST_HELPERS}/ (shared helpers)"
            bad.append(f"tests/{p.name}: move it to {where}")
        elif (p.is_dir() and p.name not in (*TEST_TIERS, TEST_HELPERS, *TEST_TOOLS, "__pycache__")
              and not p.name.startswith(".")):
            bad.append(f"tests/{p.name}/: not a tier; test modules go to one of {tiers}")
    for folder in (TEST_HELPERS, *TEST_TOOLS):
        for p in sorted((tests / folder).rglob("test_*.py")):
            bad.append(f"tests/{p.relative_to(tests).as_posix()}: a test module; move it to one of {tiers}")
    return bad


def test_no_unknown_top_level_folder():
    """A new top-level folder is a new room: name it in TOP_LEVEL (and SCANNED/RULES when it holds Python)."""
    new = unknown_top_level(ROOT)
    assert not new, (f"top-level folders this test does not know: {new}; add each to TOP_LEVEL in "
                     "tests/unit/test_architecture.py (and SCANNED/RULES if it holds Python) and to docs/architecture.md")
    python_rooms = {name for name in TOP_LEVEL if (ROOT / name).is_dir() and next((ROOT / name).rglob("*.py"), None)}
    assert python_rooms - {"tests"} <= set(SCANNED), python_rooms - {"tests"} - set(SCANNED)


def test_tests_sit_in_their_tiers():
    bad = misplaced_tests(ROOT / "tests")
    if bad:
        pytest.fail("tests outside their tiers (README, 'Run the tests'):\n" + "\n".join(bad), pytrace=False)


def test_no_test_module_imports_another():
    """Shared fixtures go to tests/conftest.py, shared helpers to tests/helpers/."""
    bad = [f"{p.relative_to(ROOT)}:{r.line}: {r.module}" for p in sorted((ROOT / "tests").rglob("*.py"))
           for r in import_records(p) if r.module.rpartition(".")[2].startswith("test_")
           or (r.name or "").startswith("test_")]
    assert not bad, "test modules importing other test modules (move the shared part to tests/helpers/):\n" + "\n".join(bad)


def process_starters(source: str) -> list[str]:
    """The names of UNIT_FORBIDDEN that ``source`` uses as code (names, ``a.b`` attributes, imported modules);
    strings and comments do not count."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
            if isinstance(node.value, ast.Name):
                used.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Import):
            used.update(part for a in node.names for part in a.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            used.update((node.module or "").split(".") + [a.name for a in node.names])
    return [w for w in UNIT_FORBIDDEN if w in used]


def test_unit_tier_starts_no_process():
    """A unit-tier file uses none of UNIT_FORBIDDEN; one that needs them belongs in tests/parallel or tests/e2e."""
    bad = [f"tests/unit/{p.name}: {', '.join(words)}" for p in sorted((ROOT / "tests" / "unit").glob("*.py"))
           if (words := process_starters(p.read_text(encoding="utf-8")))]
    assert not bad, "unit-tier files that start processes (move them to tests/parallel or tests/e2e):\n" + "\n".join(bad)


def test_the_checker_sees_misplaced_folders_and_tests(tmp_path):
    """Planted in a temporary copy of the top of the repository and of tests/."""
    for name in (*TOP_LEVEL, ".ci", "runs", "build", "x.egg-info"):
        (tmp_path / name).mkdir()
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    assert unknown_top_level(tmp_path) == []
    (tmp_path / "tools").mkdir()
    assert unknown_top_level(tmp_path) == ["tools"]
    tests = tmp_path / "tests"
    for d in (*TEST_TIERS, TEST_HELPERS, *TEST_TOOLS, "hostile/cases"):
        (tests / d).mkdir()
    for f in ("conftest.py", "__init__.py", "unit/test_a.py", "helpers/training_runs.py", "hostile/cases/store.py"):
        (tests / f).write_text("")
    assert misplaced_tests(tests) == []
    for f in ("test_new.py", "support.py", "helpers/test_b.py", "hostile/cases/test_c.py"):
        (tests / f).write_text("")
    (tests / "integration").mkdir()
    got = misplaced_tests(tests)
    assert [g.split(":")[0] for g in got] == ["tests/integration/", "tests/support.py", "tests/test_new.py",
                                              "tests/helpers/test_b.py", "tests/hostile/cases/test_c.py"]
    assert "tests/unit/ (starts no process" in got[2] and "tests/e2e/" in got[2] and "tests/helpers/" in got[1]
    probe = ROOT / "tests" / "parallel" / "test_probe.py"
    recs = import_records(probe, "from tests.unit.test_gpt_dataset import x\nfrom tests.helpers import corpora\n"
                                 "from tests.e2e import test_training\n")
    assert [r.module for r in recs if r.module.rpartition(".")[2].startswith("test_")] == [
        "tests.unit.test_gpt_dataset", "tests.e2e.test_training"]
    src = ("import subprocess, sys\nfrom tests.helpers.distributed import run_distributed\n"
           "import torch.multiprocessing as mp\ndef f():\n    subprocess.Popen([sys.executable, '-c', 'pass'])\n"
           "    return free_port()  # Popen in a comment, 'run_distributed' in a string\n")
    assert process_starters(src) == list(UNIT_FORBIDDEN)
    assert process_starters('"""run_distributed, sys.executable"""\nimport subprocess\nsubprocess.run(["git"])\n') == []


if __name__ == "__main__":  # python -m tests.unit.test_architecture: the counts of issue 32

    for key, value in counts().items():
        print(f"{key}: {value}")


# Where a build's tasks run is decided once (issue 39): ``cfg.executor`` is read by the executor module, which
# builds the executor from it, and the runner that hands that executor to every stage (here only through
# ``executor_for``); Ray itself is reached only through the executor module's ``RayExecutor``.
EXECUTOR_READERS = ("data_pipeline/executor.py", "data_pipeline/config.py")
RAY_CALLERS = ("data_pipeline/executor.py", "data_pipeline/ray_executor.py")


def executor_branches(path: Path, source: str | None = None) -> list[str]:
    """``file:line`` of every read of an ``executor`` config attribute (``cfg.executor``, ``x.executor == ...``)
    and of every import of ``data_pipeline.ray_executor`` in ``path``."""
    text = path.read_text(encoding="utf-8") if source is None else source
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() and ROOT in path.parents else str(path)
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "executor" and rel not in EXECUTOR_READERS:
            found.append(f"{rel}:{node.lineno}: reads .executor (the executor is chosen once, in "
                         "data_pipeline/executor.py, and handed to the stages)")
        if rel not in RAY_CALLERS and (
                (isinstance(node, ast.ImportFrom) and node.module == "data_pipeline.ray_executor")
                or (isinstance(node, ast.Import) and any(a.name == "data_pipeline.ray_executor" for a in node.names))):
            found.append(f"{rel}:{node.lineno}: imports data_pipeline.ray_executor (use the executor handed in)")
    return sorted(found, key=lambda x: int(x.split(":")[1]))


def test_no_executor_branch_outside_the_executor_module():
    bad = [b for p in sorted((ROOT / "data_pipeline").rglob("*.py")) for b in executor_branches(p)]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_executor_branches():
    src = ("def run(cfg):\n    if cfg.executor == 'ray':\n        from data_pipeline.ray_executor import ray_map\n"
           "    return cfg.num_workers\n")
    got = executor_branches(Path("data_pipeline/stages/filter.py"), src)
    assert len(got) == 2 and got[0].startswith("data_pipeline/stages/filter.py:2") and "ray_executor" in got[1]
    assert executor_branches(Path("data_pipeline/executor.py"), src) == []
    assert executor_branches(Path("data_pipeline/stages/filter.py"), "def run(ex):\n    return ex.map\n") == []


# --------------------------------------------------------------------------------------------------
# Config writes: a run config changes only while it is built or resolved (training.resolve), never after the freeze
# --------------------------------------------------------------------------------------------------
CONFIG_SECTIONS = ("model", "parallel", "precision", "optimizer", "train", "data", "run", "bert", "finetune")
# the modules that may set a config's fields: the resolution (the one writer of a loaded config) and those that
# build a new config from a saved one (a reader's TP=1 view, the importers' and reshard tools' output configs)
CONFIG_WRITERS = ("training.resolve", "training.checkpoint_reader", "training.tools.import_hf",
                  "training.tools.import_megatron", "training.tools.reshard", "training.tools.reshard_optim")


def _is_cfg_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and (node.id in ("cfg", "config") or node.id.endswith("_cfg"))


def _section_of(node: ast.AST, aliases: set[str]) -> bool:
    """``node`` is a config section: ``cfg.<section>`` (any depth below, e.g. ``cfg.run.wandb``) or a name bound to one."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.Attribute):
        if node.attr in CONFIG_SECTIONS and _is_cfg_name(node.value):
            return True
        return _section_of(node.value, aliases)
    return False


def config_writes(path: Path, source: str | None = None) -> list[str]:  # noqa: C901
    """``file:line`` of every assignment to a config section's field (``cfg.model.x = ...``, ``t.iters = ...``
    with ``t = cfg.train``, ``setattr(cfg.model, ...)``) in ``path`` (or ``source``)."""
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    aliases: set[str] = set()
    for node in ast.walk(tree):  # names bound to a section: t = cfg.train; m, p = cfg.model, cfg.parallel
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
                else:
                    pairs.append((target, node.value))
            for target, value in pairs:
                if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and _section_of(value, set()):
                    aliases.add(target.id)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets += t.elts if isinstance(t, ast.Tuple) else [t]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and node.args and (_section_of(node.args[0], aliases) or _is_cfg_name(node.args[0]))):
            found.append(f"{path}:{node.lineno}")
        for t in targets:
            if isinstance(t, ast.Attribute) and _section_of(t.value, aliases):
                found.append(f"{path}:{node.lineno}")
    return found


def test_the_checker_sees_config_writes():
    probe = ROOT / "training" / "probe.py"
    src = ("def f(cfg, other):\n    cfg.model.vocab_size = 3\n    t = cfg.train\n    t.iters = 4\n"
           "    setattr(cfg.model, 'x', 1)\n    cfg.run.wandb.mode = 'offline'\n    m, p = cfg.model, cfg.parallel\n"
           "    p.tensor += 1\n    other.x = 1\n    self_state = 2\n")
    assert sorted(int(w.rsplit(":", 1)[1]) for w in config_writes(probe, src)) == [2, 4, 5, 6, 8]


def test_no_config_writes_outside_the_resolution():
    """Only training.resolve (and the modules that build a new config) set a config's fields: the trainer, the
    tasks (RACE's schedule is a Task.config_changes), init_from (adopted_shape returns the shape) and the
    planner read it. A write after resolve_run's freeze would raise at run time; this finds it in the source."""
    bad = [w for top in ("training", "evaluation", "megatron_ds_suite") for p in sorted((ROOT / top).rglob("*.py"))
           if _module_name(p) not in CONFIG_WRITERS for w in config_writes(p)]
    assert not bad, "config fields set outside training.resolve (docs/architecture.md):\n" + "\n".join(bad)


def test_a_frozen_config_refuses_writes():
    """After resolve_run's freeze every section, nested ones included, refuses a write, also through
    training.resolve.apply."""
    from megatron_ds_suite.core.config import FrozenConfigError, freeze
    from training.config import config_from_dict
    from training.resolve import apply

    cfg = config_from_dict({"model": {"position_embedding": "rope", "rope_scaling": {"factor": 8.0}}})
    assert apply(cfg, {"train": {"iters": 7}}) == ["train.iters=7"] and cfg.train.iters == 7
    freeze(cfg)
    for write in (lambda: apply(cfg, {"train": {"iters": 8}}), lambda: setattr(cfg.model.rope_scaling, "factor", 2.0),
                  lambda: setattr(cfg.run.wandb, "mode", "offline"), lambda: setattr(cfg, "model", None)):
        with pytest.raises(FrozenConfigError):
            write()
    assert cfg.train.iters == 7


def defined_names(module: str) -> set[str]:
    """The functions, classes and module-level assignments of ``module`` (what it owns)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names | {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


# Owners whose names are imported from them only: (owner, the modules that once re-exported its names).
OWNED_NAMES = (("training.checkpoint_reader", None), ("training.plan.accounting", "training.metrics"))
# Files still importing a re-exported name (none left): the list only shrinks.
REEXPORT_ALLOWANCE: dict[tuple[str, str], tuple[str, ...]] = {}


def reexport_imports(files: list[Path], source: str | None = None) -> list[str]:
    """``file:line: module.name`` for each import of an owned name (OWNED_NAMES) from another module than its owner:
    any other module for ``training.checkpoint_reader``, the named re-exporter for the others. ``source``: the
    text of the one file in ``files``."""
    bad = []
    for owner, via in OWNED_NAMES:
        names = defined_names(owner)
        for p in files:
            rel = p.relative_to(ROOT).as_posix() if p.is_absolute() else p.as_posix()
            for r in import_records(p, source):
                if (r.name in names and r.module != owner and (via is None or r.module == via)
                        and rel not in REEXPORT_ALLOWANCE.get((r.module, r.name), ())):
                    bad.append(f"{rel}:{r.line}: {r.module}.{r.name} (import it from {owner})")
    return bad


def test_names_come_from_their_owner():
    """``training.checkpoint_reader``'s names are imported from it (no module re-exports them: the catalog's come from
    ``training.checkpoint_catalog``), and the FLOP counts from ``training.plan.accounting``, not ``training.metrics``,
    in the project and in the tests."""
    bad = reexport_imports(project_files() + sorted((ROOT / "tests").rglob("*.py")))
    assert not bad, "names imported through a re-export:\n" + "\n".join(bad)


def test_the_checker_sees_reexport_imports():
    probe = ROOT / "evaluation" / "probe.py"
    src = ("from training.checkpoint import read_client_state\nfrom training.checkpoint_reader import checkpoint_dir\n"
           "from training.metrics import model_flops_per_iteration, MetricsWriter\n"
           "def f():\n    from evaluation.model import load_model_for_eval\n")
    got = reexport_imports([probe], src)
    assert [g.split(": ")[1].split(" ")[0] for g in got] == [
        "training.checkpoint.read_client_state", "evaluation.model.load_model_for_eval",
        "training.metrics.model_flops_per_iteration"]


def lazy_module_tricks(path: Path, source: str | None = None) -> list[str]:
    """``file:line`` of each module-level ``__getattr__`` or ``__dir__`` (a lazy loader) and of each assignment
    to an ``__class__`` attribute outside a class (``sys.modules[__name__].__class__ = ...``, a module-class
    swap) in ``path`` (or ``source``)."""
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    found = [f"{path}:{n.lineno}" for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name in ("__getattr__", "__dir__")]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                continue
            if isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                    found.append(f"{path}:{child.lineno}")
            visit(child)

    visit(tree)
    return found


def test_the_checker_sees_lazy_module_tricks():
    probe = ROOT / "training" / "probe.py"
    src = ("import sys\ndef __getattr__(name):\n    return name\ndef __dir__():\n    return []\n"
           "class P:\n    def __getattr__(self, name):\n        self.__class__ = P\n"
           "sys.modules[__name__].__class__ = P\n")
    assert sorted(int(w.rsplit(":", 1)[1]) for w in lazy_module_tricks(probe, src)) == [2, 4, 9]


def test_packages_import_plainly():
    """No module (a package ``__init__`` included) loads its names lazily through a module ``__getattr__`` or swaps
    its module class: a name is imported from the module that defines it, with a plain import (issue 39)."""
    bad = [w for p in project_files() for w in lazy_module_tricks(p)]
    assert not bad, "lazy loaders or module-class swaps (import plainly instead):\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------
# One process spawner (issue 39): gloo ranks are started by training.runtime.spawn.run_distributed alone
# --------------------------------------------------------------------------------------------------
SPAWNER = "training/runtime/spawn.py"


def spawner_uses(path: Path, source: str | None = None) -> list[str]:
    """``file:line`` of each import of ``torch.multiprocessing`` and each call of ``start_processes`` or
    ``spawn(...)`` on a module (``mp.spawn``) in ``path`` (or ``source``): a second spawner."""
    text = path.read_text(encoding="utf-8") if source is None else source
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(a.name == "torch.multiprocessing" for a in node.names):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module == "torch.multiprocessing" or (
                node.module == "torch" and any(a.name == "multiprocessing" for a in node.names))):
            found.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("start_processes", "spawn") and isinstance(node.func.value, ast.Name)):
            found.append(node.lineno)
    return [f"{path}:{line}" for line in sorted(found)]


def test_one_process_spawner():
    """Tools, tests and benchmarks start gloo ranks through ``training.runtime.spawn.run_distributed``."""
    files = project_files() + sorted((ROOT / "tests").rglob("*.py"))
    bad = [w for p in files if p.relative_to(ROOT).as_posix() != SPAWNER for w in spawner_uses(p)]
    assert not bad, "process spawners besides training/runtime/spawn.py (call run_distributed):\n" + "\n".join(bad)


def test_the_checker_sees_spawners():
    src = ("import torch.multiprocessing as mp\nfrom torch import multiprocessing\nimport subprocess\n"
           "def f():\n    mp.start_processes(g, nprocs=2)\n    mp.spawn(g, nprocs=2)\n    subprocess.run(['x'])\n")
    assert [int(w.rsplit(":", 1)[1]) for w in spawner_uses(Path("x.py"), src)] == [1, 2, 5, 6]


# --------------------------------------------------------------------------------------------------
# The launched world size (issue 39): read in one place for the layout check, process groups started in one place
# --------------------------------------------------------------------------------------------------
# training.layout.launched_world_size is the one reader for a layout; init_distributed reads it only to choose a
# free port for one plain process (a rendezvous default, no layout)
WORLD_SIZE_READERS = ("training/layout.py", "training/runtime/distributed.py")
# every process group is started by training.runtime.distributed.init_distributed (evaluation included)
GROUP_STARTERS = ("training/runtime/distributed.py",)


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def world_size_uses(path: Path, source: str | None = None) -> list[str]:
    """``file:line: what`` for each read of ``WORLD_SIZE`` from the environment (``os.environ.get("WORLD_SIZE")``,
    ``os.environ["WORLD_SIZE"]``, ``os.getenv("WORLD_SIZE")``) and each ``init_process_group`` call in ``path``."""
    text = path.read_text(encoding="utf-8") if source is None else source
    found = []
    for node in ast.walk(ast.parse(text)):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr == "get" and _is_environ(node.func.value)) or node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        if isinstance(key, ast.Constant) and key.value == "WORLD_SIZE":
            found.append((node.lineno, "reads WORLD_SIZE"))
        if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "init_process_group"):
            found.append((node.lineno, "calls init_process_group"))
    return [f"{path}:{line}: {what}" for line, what in sorted(found)]


def test_world_size_is_read_and_groups_started_in_one_place():
    """The launched processes are compared with the layout by ``training.layout`` alone (``launch_layout``, evaluation's
    ``data_parallel_size``), and process groups are started by ``init_distributed`` alone."""
    bad = []
    for p in project_files():
        rel = p.relative_to(ROOT).as_posix()
        bad += [w for w in world_size_uses(p)
                if not (("reads WORLD_SIZE" in w and rel in WORLD_SIZE_READERS)
                        or ("init_process_group" in w and rel in GROUP_STARTERS))]
    assert not bad, ("read WORLD_SIZE through training.layout.launched_world_size, start process groups with "
                     "training.runtime.distributed.init_distributed:\n" + "\n".join(bad))


def test_the_checker_sees_world_size_reads():
    src = ("import os\nimport torch.distributed as dist\nw = int(os.environ.get('WORLD_SIZE', '1'))\n"
           "v = os.environ['WORLD_SIZE']\nu = os.getenv('WORLD_SIZE')\nos.environ.update(WORLD_SIZE='2')\n"
           "os.environ['WORLD_SIZE'] = '1'\nr = os.environ.get('RANK')\ndist.init_process_group('gloo')\n")
    assert [w.split(":", 1)[1] for w in world_size_uses(Path("x.py"), src)] == [
        "3: reads WORLD_SIZE", "4: reads WORLD_SIZE", "5: reads WORLD_SIZE", "9: calls init_process_group"]


# --------------------------------------------------------------------------------------------------
# Function-local imports defer something (issue 39): never a plain standard-library module
# --------------------------------------------------------------------------------------------------
# standard-library modules a Python build or platform may lack, or that are large: importing them inside the
# function that needs them defers or isolates something real
OPTIONAL_STDLIB = ("bz2", "lzma", "resource", "pydoc_data", "readline", "curses", "tkinter", "sqlite3")
# files being rewritten elsewhere while this rule came in (issue 39): the list only shrinks
LOCAL_STDLIB_ALLOWANCE = ("training/config.py", "training/runtime/distributed.py", "training/runtime/ds_compat.py",
                          "scripts/gpu_check.py", "benchmarks/bench_train_step.py", "benchmarks/common.py",
                          "benchmarks/hostile_probe.py")


def local_stdlib_imports(path: Path, source: str | None = None) -> list[str]:
    """``file:line: module`` for each standard-library import inside a function of ``path`` (or ``source``),
    OPTIONAL_STDLIB left out: it defers nothing, so it belongs at the top of the module."""
    text = path.read_text(encoding="utf-8") if source is None else source
    std = set(sys.stdlib_module_names) - {"__future__"}
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if local and isinstance(child, (ast.Import, ast.ImportFrom)):
                names = ([a.name for a in child.names] if isinstance(child, ast.Import)
                         else [child.module or ""] if not child.level else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in std and top not in OPTIONAL_STDLIB:
                        found.append(f"{path}:{child.lineno}: {name}")
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(text), False)
    return found


def test_no_function_local_standard_library_imports():
    """A standard-library import inside a function defers nothing (move it to the top); third-party and project
    imports inside functions stay where they defer a heavy or optional package (torch, deepspeed, ray, ...)."""
    bad = [w for p in project_files() if p.relative_to(ROOT).as_posix() not in LOCAL_STDLIB_ALLOWANCE
           for w in local_stdlib_imports(p)]
    assert not bad, "standard-library imports inside functions (move them to the top of the module):\n" + "\n".join(bad)


def test_the_checker_sees_local_standard_library_imports():
    src = ("import os\ndef f():\n    import json\n    from pathlib import Path\n    import lzma\n    import torch\n"
           "    from . import sibling\n    return lambda: __import__('x')\n")
    assert [int(w.split(":")[1]) for w in local_stdlib_imports(Path("x.py"), src)] == [3, 4]
