"""Pip constraints that pin each runtime dependency to the oldest version pyproject.toml allows.

The lower bounds in ``pyproject.toml`` are claims ("the code works with datasketch 2.0"); this turns
them into something an install can test. For every entry of ``[project] dependencies`` with a ``>=``
bound it prints ``name==bound``; ``scripts/check_oldest.sh`` installs the project under that file and
runs the tests that exercise those packages (docs/dependencies.md).

Two kinds of dependency are not pinned to their bound:

* torch stays at the version in ``constraints.txt`` (the one CI tests, and on CI machines a local wheel):
  the oldest allowed torch would be a separate download, about 200 MB for a CPU wheel and several GB for
  PyPI's CUDA build with its NVIDIA libraries, which is too much for a routine check. Its bound (``torch>=2.4``, fused AdamW on CPU) is the one such check
  does not cover; ``scripts/torch_source.py`` enforces it at set-up.
* the names in ``EXCLUDED`` below, each with the reason.

Stdlib only (``tomllib``, Python 3.11+).

    python scripts/oldest_constraints.py [--pyproject PATH] [--constraints PATH] > oldest.txt
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

import tomllib

ROOT = Path(__file__).resolve().parent.parent

# Dependencies kept out of the oldest-versions pin, with the reason (name as written in pyproject.toml,
# compared after PEP 503 normalisation). torch is handled separately (module docstring).
EXCLUDED: dict[str, str] = {}

# "name[extra] >=1.2, <2 ; marker" -> name, the specifier list
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def normalize(name: str) -> str:
    """PEP 503 normalised project name: 'PyYAML' -> 'pyyaml', 'huggingface_hub' -> 'huggingface-hub'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lower_bound(requirement: str) -> tuple[str, Optional[str]]:
    """(name, the version after ``>=``, or None when the requirement has no ``>=`` clause)."""
    m = _REQUIREMENT.match(requirement)
    if not m:
        raise ValueError(f"cannot parse requirement {requirement!r}")
    name, specs = m.group(1), m.group(2)
    for spec in specs.split(","):
        spec = spec.strip()
        if spec.startswith(">="):
            return name, spec[2:].strip()
    return name, None


def pinned_version(constraints: Path, name: str) -> Optional[str]:
    """The ``name==VERSION`` line of a pip freeze style constraints file, or None."""
    want = normalize(name)
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            pkg, version = line.split("==", 1)
            if normalize(pkg) == want:
                return version.strip()
    return None


def oldest_constraints(pyproject: Path = ROOT / "pyproject.toml",
                       constraints: Path = ROOT / "constraints.txt") -> list[str]:
    """The lines of the constraints file: comments saying what was left out, then one pin per dependency."""
    deps: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    excluded = {normalize(k): why for k, why in EXCLUDED.items()}
    lines = [f"# oldest allowed versions of the runtime dependencies in {pyproject.name} "
             f"(scripts/oldest_constraints.py)"]
    pins: list[str] = []
    for req in deps:
        name, bound = lower_bound(req)
        key = normalize(name)
        if key == "torch":
            tested = pinned_version(constraints, "torch")
            if tested is None:
                raise SystemExit(f"oldest_constraints: no torch== line in {constraints}")
            lines.append(f"# torch: the tested {tested} from {constraints.name}, not its bound {bound} "
                         f"(the oldest torch is a separate large download)")
            pins.append(f"torch=={tested}")
        elif key in excluded:
            lines.append(f"# {name}: not pinned, {excluded[key]}")
        elif bound is None:
            lines.append(f"# {name}: no >= bound in {pyproject.name}, not pinned")
        else:
            pins.append(f"{name}=={bound}")
    return lines + pins


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    p.add_argument("--constraints", type=Path, default=ROOT / "constraints.txt",
                   help="where torch's tested version is read (default: the repository's constraints.txt)")
    args = p.parse_args(argv)
    print("\n".join(oldest_constraints(args.pyproject, args.constraints)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
