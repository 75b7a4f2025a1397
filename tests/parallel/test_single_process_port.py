"""A plain single-process run (no launcher) initialises its process group on a free port, in a child
interpreter beside a socket holding the default one (the error-class tests are tests/unit/test_error_base.py)."""
from __future__ import annotations


def test_single_process_without_launcher_takes_a_free_port():
    """Two plain single-process runs on one machine: the second no longer fails binding the fixed 29500
    (issue 29); an explicit MASTER_PORT is still honoured."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("from training.runtime.distributed import init_distributed; init_distributed('gloo'); "
            "import os, torch.distributed as d; print(os.environ['MASTER_PORT'], d.get_world_size())")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE",
                                                             "LOCAL_RANK")}
    env.update(PYTHONPATH=str(root), DS_ACCELERATOR="cpu")
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen(1)
        except OSError:
            pass  # already taken by something else: taken either way
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        port, world = out.stdout.split()[-2:]
        assert port != "29500" and world == "1"
    finally:
        busy.close()
