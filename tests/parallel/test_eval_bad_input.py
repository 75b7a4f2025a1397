"""Evaluation inputs that used to end in a traceback (issue 38), each one line and exit code 2 now: a ``--prompt`` that
is not UTF-8, non-finite logits while sampling (a damaged checkpoint, a temperature that overflows), a ``--json``
path that cannot be written (checked before anything is scored), and the lm-eval adapter's local files and hub
tasks on an offline machine (refused at once, not after ~23 s of retries)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import SHARED_DATA

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
LAMBADA = Path(SHARED_DATA) / "eval" / "lambada" / "lambada_test.jsonl"


@pytest.fixture(scope="module")
def loaded(random_gpt2):
    from evaluation.generate import load_generator

    return load_generator(random_gpt2[1])


def _error_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip() and " INFO " not in x and " WARNING " not in x]
    assert len(lines) == 1, lines
    return lines[0]


# ---- a prompt argument that is not UTF-8 -------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,byte", [("\udcff", "0xff"), ("good text \udc80 then more", "0x80"),
                                         ("caf\udcc3", "0xc3"), ("\udce2\udc82", "0xe2")])
def test_a_prompt_argument_that_is_not_utf8_is_one_line(random_gpt2, tmp_path, capsys, prompt, byte):
    """Python reads argument bytes that are not UTF-8 as lone surrogates (U+DC80..U+DCFF)."""
    from evaluation.cli import main

    out = tmp_path / "g.json"
    assert main(["generate", "--checkpoint", str(random_gpt2[1]), "--prompt", "fine", "--prompt", prompt,
                 "--max-new-tokens", "2", "--no-progress", "--json", str(out)]) == 2
    line = _error_line(capsys)
    assert line.startswith("error: --prompt number 2 is not UTF-8 text") and f"byte {byte}" in line, line
    assert not out.exists()


def test_a_non_utf8_prompt_from_a_real_command_line_is_one_line(random_gpt2, tmp_path):
    res = subprocess.run([os.fsencode(sys.executable), b"-m", b"evaluation", b"generate", b"--checkpoint",
                          os.fsencode(random_gpt2[1]), b"--prompt", b"\xff\xfe", b"--no-progress", b"--json",
                          os.fsencode(tmp_path / "g.json")], cwd=ROOT, capture_output=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu"))
    err = [x for x in res.stderr.decode(errors="replace").splitlines() if x.strip() and " INFO " not in x]
    assert res.returncode == 2 and len(err) == 1 and "is not UTF-8 text (byte 0xff" in err[0], err


# ---- non-finite logits in sampling -------------------------------------------------------------------------------
@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_a_checkpoint_with_non_finite_weights_stops_generation_in_one_line(loaded, poison, greedy):
    from evaluation.errors import EvalError
    from evaluation.generate import GenerationOptions, generate

    model, tok = copy.deepcopy(loaded[0]), loaded[1]
    with torch.no_grad():
        model.embedding.word_embeddings.weight[:, 0] = float(poison)  # every token's first feature
    with pytest.raises(EvalError, match=r"non-finite value\(s\) \(NaN or infinity\): the checkpoint's weights"):
        generate(model, tok, ["Hello there"], GenerationOptions(max_new_tokens=3, greedy=greedy))


@pytest.mark.parametrize("temperature", [1e-42, 1e-45])
def test_a_temperature_whose_logits_overflow_is_one_line(loaded, temperature):
    from evaluation.errors import EvalError
    from evaluation.generate import GenerationOptions, generate

    with pytest.raises(EvalError, match=f"temperature {temperature} is too small"):
        generate(*loaded, ["Hello there"], GenerationOptions(max_new_tokens=3, temperature=temperature))


@pytest.mark.parametrize("temperature", ["inf", "nan", "1e999"])
def test_a_non_finite_temperature_is_refused_before_loading(random_gpt2, capsys, temperature):
    from evaluation.cli import main

    assert main(["generate", "--checkpoint", str(random_gpt2[1]), "--prompt", "x", f"--temperature={temperature}",
                 "--no-progress"]) == 2
    assert _error_line(capsys).startswith("error: temperature must be a finite number > 0")


# ---- an output file that cannot be written: refused before scoring -------------------------------------------------
def _json_targets(tmp_path: Path) -> list[tuple[str, str]]:
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    return [(str(tmp_path / "a_file" / "r.json"), "is a file, not a folder"),
            (str(tmp_path / "a_folder"), "is a folder"),
            ("/proc/no/r.json", "cannot write into /proc")]


@pytest.mark.parametrize("task", ["generate", "wikitext103", "lambada", "lm-eval"])
def test_an_unwritable_json_path_is_refused_before_anything_is_scored(random_gpt2, tmp_path, capsys, monkeypatch, task):
    import evaluation.model as model
    from evaluation.cli import main

    def never(*a, **k):  # noqa: ARG001
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(model, "setup_runtime", never)
    words = tmp_path / "w.tokens"
    words.write_text(" = T = \n the quick brown fox jumps over the lazy dog \n" * 5)
    args = {"generate": ["--prompt", "hello"], "wikitext103": ["--data", str(words)],
            "lambada": ["--data", str(LAMBADA), "--limit", "2"],
            "lm-eval": ["--tasks", "wikitext_local", "--wikitext", str(words)]}[task]
    for target, message in _json_targets(tmp_path):
        assert main([task, "--checkpoint", str(random_gpt2[1]), *args, "--json", target]) == 2, target
        line = _error_line(capsys)
        assert line.startswith(f"error: --json {target}") and message in line, line


# ---- the lm-eval adapter ----------------------------------------------------------------------------------------
def test_lm_eval_local_files_that_cannot_be_read_are_one_line(random_gpt2, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from evaluation.cli import main

    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)))
    not_json = tmp_path / "l.jsonl"
    not_json.write_text('{"text": "fine"}\nthis is not json\n')
    cases = [(["--tasks", "wikitext_local", "--wikitext", str(binary)], "--wikitext " + str(binary) + " is not UTF-8"),
             (["--tasks", "lambada_openai_local", "--lambada", str(binary)], str(binary)),
             (["--tasks", "lambada_openai_local", "--lambada", str(not_json)], f"{not_json}:2"),
             (["--tasks", "lambada_openai_local", "--lambada", str(tmp_path / "none.jsonl")], "does not exist"),
             (["--tasks", "lambada_openai", "--include-path", str(tmp_path / "none")], "--include-path")]
    for args, message in cases:
        assert main(["lm-eval", "--checkpoint", str(random_gpt2[1]), *args, "--json", str(tmp_path / "r.json")]) == 2
        line = _error_line(capsys)
        assert line.startswith("error: ") and message in line, (args, line)


@pytest.mark.parametrize("tasks", ["lambada_openai", "hellaswag,wikitext_local", "lambada"])
def test_lm_eval_hub_tasks_offline_fail_fast_in_one_line(random_gpt2, tmp_path, capsys, monkeypatch, tasks):
    pytest.importorskip("lm_eval")
    from evaluation.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    words = tmp_path / "w.tokens"
    words.write_text(" = T = \n the quick brown fox \n")
    t0 = time.monotonic()
    assert main(["lm-eval", "--checkpoint", str(random_gpt2[1]), "--tasks", tasks, "--wikitext", str(words),
                 "--json", str(tmp_path / "r.json")]) == 2
    line = _error_line(capsys)
    assert "read their data from the Hugging Face hub, which is unreachable (HF_HUB_OFFLINE" in line, line
    assert "wikitext_local" not in line.split("unreachable")[0]  # the local task is not blamed
    assert time.monotonic() - t0 < 15  # no retries
    assert not (tmp_path / "r.json").exists()


def test_lm_eval_local_tasks_still_run_offline(random_gpt2, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from evaluation.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    words = tmp_path / "w.tokens"
    words.write_text(" = T = \n the quick brown fox jumps over the lazy dog \n")
    out = tmp_path / "r.json"
    assert main(["lm-eval", "--checkpoint", str(random_gpt2[1]), "--tasks", "wikitext_local", "--wikitext", str(words),
                 "--json", str(out)]) == 0
    assert "wikitext_local" in json.loads(out.read_text())["results"]
