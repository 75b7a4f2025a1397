"""Evaluation (``python -m evaluation``): damaged checkpoints, empty, binary, nested or cut data files, wrong
arguments, generation on poisoned weights, result files that cannot be written, lm-eval inputs.
"""
from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

from tests.hostile.case import case
from tests.hostile.commands import free_port
from tests.hostile.damage import binary_file, plant_evil, pwned, swap_merges, truncate
from tests.hostile.fixtures import copy_of, fixture, latest_tag_dir


def _words(tmp: Path) -> Path:
    f = tmp / "w.tokens"
    f.write_text(" = Title = \n the cat sat on the mat and the dog sat on the log . \n" * 4, encoding="utf-8")
    return f


def _wikitext(run: Path, data: Path, *extra: str) -> list[str]:
    return ["python", "-m", "evaluation", "wikitext103", "--checkpoint", str(run), "--data", str(data),
            "--no-progress", "--json", str(data.parent / "r.json"), *extra]


@case("evaluation", "wikitext_ok", "WikiText perplexity of the tiny run (control)", "ok")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp))


@case("evaluation", "checkpoint_missing", "`--checkpoint` names nothing")
def _(p, tmp):
    return _wikitext(tmp / "none", _words(tmp))


@case("evaluation", "checkpoint_is_corpus", "a corpus folder passed as `--checkpoint`")
def _(p, tmp):
    return _wikitext(fixture(p, "corpus"), _words(tmp))


@case("evaluation", "checkpoint_binary_latest", "a binary checkpoints/latest")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (run / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_missing_tp_shard", "a TP=2 checkpoint with mp_rank_01 deleted")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_truncated", "the model file cut short")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    f = latest_tag_dir(run) / "mp_rank_00_model_states.pt"
    truncate(f, 4096)
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_zero_byte", "the model file emptied (0 bytes)")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (latest_tag_dir(run) / "mp_rank_00_model_states.pt").write_bytes(b"")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_latest_deleted", "checkpoints/latest lost: the line must name the tag to pass")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (run / "checkpoints" / "latest").unlink()
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_malicious_pickle", "a model file whose pickle runs code", check=pwned)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    plant_evil(p, latest_tag_dir(run) / "mp_rank_00_model_states.pt", tmp / "PWNED")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_symlinked_tag", "the latest tag folder is a symlink")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    tag = latest_tag_dir(run)
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_tokenizer_swapped", "the run's tokenizer files edited after training (same size)")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    swap_merges(run / "tokenizer")
    return _wikitext(run, _words(tmp))


@case("evaluation", "wikitext_empty", "an empty WikiText file")
def _(p, tmp):
    (tmp / "e.tokens").write_text("")
    return _wikitext(fixture(p, "run"), tmp / "e.tokens")


@case("evaluation", "wikitext_one_word", "a WikiText file of one word")
def _(p, tmp):
    (tmp / "e.tokens").write_text(" hello \n")
    return _wikitext(fixture(p, "run"), tmp / "e.tokens")


@case("evaluation", "wikitext_binary", "a binary WikiText file")
def _(p, tmp):
    binary_file(tmp / "b.tokens")
    return _wikitext(fixture(p, "run"), tmp / "b.tokens")


@case("evaluation", "wikitext_missing", "`--data` names nothing")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), tmp / "none.tokens")


@case("evaluation", "wikitext_tp_too_large", "`--tp 2` in a single process")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--tp", "2")


@case("evaluation", "wikitext_seq_too_long", "`--seq-length 4096` beyond the model's positions")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--seq-length", "4096")


@case("evaluation", "hf_dataset_loading_script", "`--hf-dataset` naming a loading script",
      check=lambda p, tmp, res: "the loading script ran" if (tmp / "PWNED").exists() else None)
def _(p, tmp):
    (tmp / "ds").mkdir()
    (tmp / "ds" / "ds.py").write_text(f"open({str(tmp / 'PWNED')!r}, 'w').write('x')\n")
    return ["python", "-m", "evaluation", "wikitext103", "--checkpoint", str(fixture(p, "run")), "--hf-dataset",
            str(tmp / "ds"), "--no-progress", "--json", str(tmp / "r.json")]


def _lambada(run: Path, data: Path) -> list[str]:
    return ["python", "-m", "evaluation", "lambada", "--checkpoint", str(run), "--data", str(data), "--no-progress",
            "--json", str(data.parent / "r.json")]


@case("evaluation", "lambada_binary", "a binary LAMBADA file")
def _(p, tmp):
    binary_file(tmp / "l.jsonl")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "lambada_bad_lines", "LAMBADA lines without `text`, cut JSON, nested 1,000 deep", "either")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_text("\n".join([good, '{"nope": 1}', '{"text": "cut', "[" * 1000 + "]" * 1000,
                                            good]) + "\n")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "lambada_nested_line", "a LAMBADA line nested 1,000 deep")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_text("\n".join([good, "[" * 1000 + "]" * 1000, good]) + "\n")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "lambada_huge_number", "a LAMBADA line holding a 100,000-digit number")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_text("\n".join([good, '{"text": "a b", "n": ' + "9" * 100000 + "}", good]) + "\n")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "wikitext_batch_size_zero", "`--batch-size 0`")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--batch-size", "0")


@case("evaluation", "wikitext_limit_negative", "`--limit -1`")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--limit", "-1")


@case("evaluation", "generate_prompts_nested_jsonl", "a `--prompts` .jsonl line nested 1,000 deep")
def _(p, tmp):
    (tmp / "p.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n" + "[" * 1000 + "]" * 1000 + "\n")
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompts",
            str(tmp / "p.jsonl"), "--max-new-tokens", "2", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "lambada_bom", "a LAMBADA file starting with a UTF-8 BOM", "ok",
      check=lambda p, tmp, res: None if '"count": 2' in (tmp / "r.json").read_text() or
      '"n": 2' in (tmp / "r.json").read_text() or '2' in (tmp / "r.json").read_text() else "a record was lost")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_bytes(b"\xef\xbb\xbf" + (good + "\n" + good + "\n").encode())
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "generate_binary_prompts", "a binary `--prompts` file")
def _(p, tmp):
    binary_file(tmp / "p.txt")
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompts",
            str(tmp / "p.txt"), "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_negative_tokens", "`generate --max-new-tokens -1`")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--max-new-tokens", "-1", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_top_p_range", "`generate --top-p 5`")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--top-p", "5", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_tp2_launcher", "`generate --tp 2` under the launcher (teardown at exit)", "ok",
      timeout=300, check=lambda p, tmp, res: None if (tmp / "r.json").is_file() else "no output written")
def _(p, tmp):
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "evaluation", "generate",
            "--checkpoint", str(fixture(p, "run_tp2")), "--tp", "2", "--prompt", "hello world",
            "--max-new-tokens", "4", "--greedy", "--no-progress", "--json", str(tmp / "r.json")]


def _one_error_line(p, tmp, res):
    n = sum(bool(re.match(r"^(\[rank\d+\]: )?(checkpoint )?error: ", line)) for line in res.out.splitlines())
    return None if n == 1 else f"{n} error lines (one per rank?)"


@case("evaluation", "tp2_launcher_truncated_shard", "`wikitext103 --tp 2` under the launcher, rank 1's shard cut short",
      timeout=300, check=_one_error_line)
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    f = next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt"))
    truncate(f, 4096)
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "evaluation", "wikitext103",
            "--checkpoint", str(run), "--tp", "2", "--data", str(_words(tmp)), "--no-progress", "--json",
            str(tmp / "r.json")]


@case("evaluation", "heldout_without_corpus", "`heldout --corpus` names nothing")
def _(p, tmp):
    return ["python", "-m", "evaluation", "heldout", "--checkpoint", str(fixture(p, "run")), "--corpus",
            str(tmp / "none"), "--split", "949,50,1", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "race_on_gpt", "`race` on a GPT-2 checkpoint")
def _(p, tmp):
    for level in ("middle", "high"):
        race = tmp / "RACE" / "dev" / level
        race.mkdir(parents=True)
        (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"],
                                                "options": [["a", "b", "c", "d"]], "answers": ["A"], "id": "1.txt"}))
    return ["python", "-m", "evaluation", "race", "--checkpoint", str(fixture(p, "run")), "--data",
            str(tmp / "RACE"), "--split", "dev", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "race_folder_missing", "`race --data` names nothing")
def _(p, tmp):
    return ["python", "-m", "evaluation", "race", "--checkpoint", str(fixture(p, "run")), "--data",
            str(tmp / "none"), "--split", "dev", "--no-progress", "--json", str(tmp / "r.json")]


RACE_READ = textwrap.dedent("""
    import sys
    from megatron_ds_suite.core.race import read_race_dir
    res = read_race_dir(sys.argv[1])
    qs = res[0] if isinstance(res, tuple) else res
    print("questions", len(qs))
""")


@case("evaluation", "race_empty_file", "an empty RACE article file among good ones (read_race_dir)", "ok",
      check=lambda p, tmp, res: None if re.search(r"skipped [1-9]", res.out) else "the empty file was not reported")
def _(p, tmp):
    race = tmp / "RACE" / "dev" / "middle"
    race.mkdir(parents=True)
    (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"], "options": [["a", "b", "c", "d"]],
                                            "answers": ["A"], "id": "1.txt"}))
    (race / "2.txt").write_text("")
    return ["python", "-c", RACE_READ, str(race)]


def _race_dir(tmp: Path, bad: str) -> Path:
    race = tmp / "RACE" / "dev" / "middle"
    race.mkdir(parents=True)
    (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"], "options": [["a", "b", "c", "d"]],
                                            "answers": ["A"], "id": "1.txt"}))
    (race / "2.txt").write_text(bad)
    return race


@case("evaluation", "race_nested_file", "a RACE file nested 1,000 deep (read_race_dir)", "ok",
      check=lambda p, tmp, res: None if re.search(r"skipped [1-9]", res.out) else "the bad file was not reported")
def _(p, tmp):
    return ["python", "-c", RACE_READ, str(_race_dir(tmp, "[" * 1000 + "]" * 1000))]


@case("evaluation", "race_huge_number", "a RACE file holding a 100,000-digit number (read_race_dir)", "ok",
      check=lambda p, tmp, res: None if re.search(r"skipped [1-9]", res.out) else "the bad file was not reported")
def _(p, tmp):
    return ["python", "-c", RACE_READ, str(_race_dir(tmp, '{"article": ' + "9" * 100000 + "}"))]


@case("evaluation", "generate_prompt_not_utf8", "`generate --prompt $'\\xff'` (argument bytes that are not UTF-8)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "\udcff",
            "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_prompt_cut_utf8", "`generate --prompt` ending in a cut UTF-8 sequence (`caf\\xc3`)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "caf\udcc3",
            "--no-progress", "--json", str(tmp / "r.json")]


NAN_WEIGHTS = textwrap.dedent("""
    import sys, torch
    f = sys.argv[1]
    sd = torch.load(f, map_location="cpu", weights_only=False)
    module = sd["module"]
    key = next(k for k in module if k.endswith("word_embeddings.weight"))
    module[key][:, 0] = float(sys.argv[2])
    torch.save(sd, f)
""")


def _poisoned_run(p, tmp, value: str) -> Path:
    run = copy_of(p, "run", tmp / "run")
    res = p.run(["python", "-c", NAN_WEIGHTS, str(latest_tag_dir(run) / "mp_rank_00_model_states.pt"), value],
                timeout=120)
    if res.rc != 0:
        raise RuntimeError(res.out[-2000:])
    return run


@case("evaluation", "generate_nan_weights", "`generate` (sampling) on a checkpoint with NaN embedding weights")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(_poisoned_run(p, tmp, "nan")), "--prompt",
            "hello", "--max-new-tokens", "3", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_inf_weights_greedy", "`generate --greedy` on a checkpoint with infinite weights")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(_poisoned_run(p, tmp, "inf")), "--prompt",
            "hello", "--max-new-tokens", "3", "--greedy", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_tiny_temperature", "`generate --temperature 1e-45` (logits / T overflow)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--temperature", "1e-45", "--max-new-tokens", "3", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "json_parent_is_file", "`wikitext103 --json FILE/r.json` (found only after scoring)")
def _(p, tmp):
    (tmp / "f").write_text("x")
    return _wikitext(fixture(p, "run"), _words(tmp))[:-2] + ["--json", str(tmp / "f" / "r.json")]


@case("evaluation", "json_is_folder", "`generate --json` an existing folder")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--max-new-tokens", "2", "--no-progress", "--json", str(tmp)]


@case("evaluation", "lm_eval_hub_task_offline", "`lm-eval --tasks lambada_openai` offline (HF_HUB_OFFLINE=1)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks", "lambada_openai",
            "--limit", "2", "--json", str(tmp / "r.json")]


@case("evaluation", "lm_eval_wikitext_binary", "`lm-eval --wikitext` a binary file")
def _(p, tmp):
    binary_file(tmp / "w.tokens")
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks", "wikitext_local",
            "--wikitext", str(tmp / "w.tokens"), "--json", str(tmp / "r.json")]


@case("evaluation", "lm_eval_lambada_not_json", "`lm-eval --lambada` a file whose second line is not JSON")
def _(p, tmp):
    (tmp / "l.jsonl").write_text('{"text": "a b c d"}\nnot json\n')
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks",
            "lambada_openai_local", "--lambada", str(tmp / "l.jsonl"), "--json", str(tmp / "r.json")]


@case("evaluation", "lm_eval_json_parent_is_file", "`lm-eval --json FILE/r.json` (results lost after scoring)")
def _(p, tmp):
    (tmp / "f").write_text("x")
    (tmp / "w.tokens").write_text(" = T = \n the quick brown fox jumps over the lazy dog \n")
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks", "wikitext_local",
            "--wikitext", str(tmp / "w.tokens"), "--json", str(tmp / "f" / "r.json")]
