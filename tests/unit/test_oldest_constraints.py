"""scripts/oldest_constraints.py (issue 16): the pins scripts/check_oldest.sh installs are the >= bounds
of pyproject.toml, one per runtime dependency, torch kept at the tested version."""
from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from scripts.oldest_constraints import lower_bound, normalize, oldest_constraints, pinned_version

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("req, expected", [
    ("deepspeed>=0.19,<0.20", ("deepspeed", "0.19")),
    ("tqdm >= 4.62.1", ("tqdm", "4.62.1")),
    ("lm-eval[hf]==0.4.13", ("lm-eval", None)),
    ("regex", ("regex", None)),
])
def test_lower_bound(req, expected):
    assert lower_bound(req) == expected


def test_every_runtime_dependency_is_pinned_to_its_bound(tmp_path):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [line for line in oldest_constraints() if not line.startswith("#")]
    by_name = dict(line.split("==", 1) for line in pins)
    assert len(by_name) == len(deps)
    for req in deps:
        name, bound = lower_bound(req)
        if normalize(name) == "torch":
            assert by_name[name] == pinned_version(ROOT / "constraints.txt", "torch")
        else:
            assert by_name[name] == bound, req
    # a freeze-style file: comments and case/underscore differences are ignored
    c = tmp_path / "c.txt"
    c.write_text("# header\nPyYAML==6.0.3\nhuggingface_hub==0.36.2  # note\n")
    assert pinned_version(c, "pyyaml") == "6.0.3" and pinned_version(c, "huggingface-hub") == "0.36.2"
    assert pinned_version(c, "torch") is None
