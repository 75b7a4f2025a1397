"""The allowed import directions of docs/architecture.md, checked on every non-test module.

Each module of the project is parsed with ``ast`` (imports inside functions and ``TYPE_CHECKING`` blocks
included; relative imports resolved), every project import is matched against the rules of the room the
module lives in, and a wrong-way import fails the test with ``file:line: importer -> imported (rule)``.
"""
from __future__ import annotations

import ast
from pathlib import Path

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
    ("training.parallel", ("training.parallel",), (),
     "training/parallel imports only torch, the standard library and other parallel modules"),
    ("data_pipeline", ("data_pipeline", *CORE), (), "data_pipeline imports only the core"),
    ("training", ("training", *CORE), (), "training imports the core (not data_pipeline, not evaluation)"),
    ("evaluation", ("evaluation", "training", *CORE), (), "evaluation imports the core and training"),
    ("benchmarks", (), ("tests",), "benchmarks must not import tests (shared helpers: megatron_ds_suite.testing)"),
    ("scripts", (), ("tests", "benchmarks"), "scripts may import the stages, not tests or benchmarks"),
    ("megatron_ds_suite", (), ("tests", "benchmarks", "scripts"),
     "the main job, the console and the test helpers may import every stage, not tests, benchmarks or scripts"),
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


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, imported project module) for every import in ``path`` (or in ``source``, read as that file)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                found.append((node.lineno, sub if _is_module(sub) else base))
    return [(line, name) for line, name in found if name.split(".")[0] in PROJECT]


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


def violations() -> list[str]:
    bad = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            me = _module_name(path)
            for line, target in imports(path):
                words = wrong_way(me, target)
                if words:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {me} -> {target} ({words})")
    return bad


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
    assert not wrong_way("megatron_ds_suite.main_job.job", "data_pipeline.stages")


def test_imports_follow_the_allowed_directions():
    bad = violations()
    if bad:
        pytest.fail("wrong-way imports (docs/architecture.md):\n" + "\n".join(bad), pytrace=False)
