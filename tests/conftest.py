"""Fixtures shared by several test files."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


@pytest.fixture()
def redis_port(tmp_path):
    """A real redis-server on a free loopback port, started for the test and stopped after it."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not found on PATH (apt-get install -y redis-server)")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def random_gpt2(tmp_path_factory):
    """(folder, run dir): a random transformers GPT-2 saved locally (tests/hf_models.py) and its TP=1
    import by training.tools.import_hf; shared by the import and generation tests."""
    pytest.importorskip("transformers")
    from tests.hf_models import GPT2_TOKENIZER, save_random_gpt2

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from training.tools.import_hf import import_hf

    root = tmp_path_factory.mktemp("random_gpt2")
    src = save_random_gpt2(root / "hf")
    return src, import_hf(str(src), root / "imported")
