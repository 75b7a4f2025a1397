"""The default configs shipped inside the package, readable wherever the project is installed.

``configs/`` of the repository is bundled as package data (``megatron_ds_suite/configs`` is a link to it
in the checkout, a real folder in a wheel), so ``--config gpt2_tiny.yaml`` works from any directory after
``pip install``: a config argument that is not an existing file is looked up here (``gpt2_tiny``,
``gpt2_tiny.yaml``, ``configs/gpt2_tiny.yaml`` and ``data/default.yaml`` all name bundled files). Paths
inside the configs stay relative to the working directory, so nothing is written into the package.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_root() -> Path:
    """Folder of the bundled configs (a real directory: editable checkout or unpacked wheel)."""
    return Path(str(resources.files("megatron_ds_suite") / "configs"))


def list_configs() -> list[str]:
    """Names of the bundled configs relative to the bundle, e.g. ``gpt2_tiny.yaml``, ``data/default.yaml``."""
    root = bundled_root()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.yaml"))


def bundled_config(name: str) -> Path | None:
    """The bundled config ``name`` names (with or without ``.yaml``, with or without a leading
    ``configs/``), or None."""
    rel = name[len("configs/"):] if name.startswith("configs/") else name
    if not rel.endswith((".yaml", ".yml")):
        rel += ".yaml"
    path = bundled_root() / rel
    return path if path.is_file() and ".." not in Path(rel).parts else None


def find_config(path: str | Path) -> Path:
    """``path`` if it is an existing file, else the bundled config of that name, else ``path`` unchanged
    (the caller reports the missing file)."""
    p = Path(path)
    if p.is_file():
        return p
    return bundled_config(str(path)) or p
