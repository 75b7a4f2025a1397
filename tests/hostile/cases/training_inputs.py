"""Training (``python -m training.pretrain``) on wrong configs and damaged data: typos, wrong types, ranges,
binary or empty text files, corpora that are not corpora, token ids beyond the vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path

from tests.hostile.case import case
from tests.hostile.commands import train_cmd
from tests.hostile.damage import binary_file, damage_bin
from tests.hostile.fixtures import copy_of, fixture, gpt2_spec
from tests.hostile.probe import Probe


@case("training", "train_ok", "a correct two-step run (control)", "ok")
def _(p, tmp):
    return train_cmd(p, tmp)


@case("training", "config_typo_key", "`train.iter=5` (typo of iters)")
def _(p, tmp):
    return train_cmd(p, tmp, "train.iter=5")


@case("training", "config_missing", "--config names no file")
def _(p, tmp):
    return ["python", "-m", "training.pretrain", "--config", str(tmp / "nope.yaml")]


@case("training", "config_binary", "--config is a binary file")
def _(p, tmp):
    binary_file(tmp / "c.yaml")
    return ["python", "-m", "training.pretrain", "--config", str(tmp / "c.yaml")]


@case("training", "override_no_equals", "an override without `=`")
def _(p, tmp):
    return train_cmd(p, tmp, "train.iters")


@case("training", "wrong_type", "`train.iters=many`")
def _(p, tmp):
    return train_cmd(p, tmp, "train.iters=many")


@case("training", "negative_save_interval", "`train.save_interval=-1` (saved every step)")
def _(p, tmp):
    return train_cmd(p, tmp, "train.save_interval=-1")


@case("training", "negative_eval_interval", "`train.eval_interval=-1`")
def _(p, tmp):
    return train_cmd(p, tmp, "train.eval_interval=-1")


@case("training", "negative_log_interval", "`train.log_interval=-1`")
def _(p, tmp):
    return train_cmd(p, tmp, "train.log_interval=-1")


@case("training", "keep_last_zero", "`train.keep_last=0`")
def _(p, tmp):
    return train_cmd(p, tmp, "train.keep_last=0")


@case("training", "negative_lr", "`optimizer.lr=-1`")
def _(p, tmp):
    return train_cmd(p, tmp, "optimizer.lr=-1")


@case("training", "batch_not_divisible", "global batch 3 with micro batch 2")
def _(p, tmp):
    return train_cmd(p, tmp, "train.global_batch_size=3")


@case("training", "tp_not_dividing_heads", "`parallel.tensor=3` with 4 heads")
def _(p, tmp):
    return train_cmd(p, tmp, "parallel.tensor=3")


@case("training", "iters_negative", "`train.iters=-5`")
def _(p, tmp):
    return train_cmd(p, tmp, "train.iters=-5")


@case("training", "num_layers_zero", "`model.num_layers=0`")
def _(p, tmp):
    return train_cmd(p, tmp, "model.num_layers=0")


@case("training", "seq_length_zero", "`model.seq_length=0`")
def _(p, tmp):
    return train_cmd(p, tmp, "model.seq_length=0")


@case("training", "split_no_train", "`data.split=0,0,1`")
def _(p, tmp):
    return train_cmd(p, tmp, "data.split=0,0,1")


@case("training", "no_data", "`data.corpus=null` and no other data")
def _(p, tmp):
    return train_cmd(p, tmp, "data.corpus=null")


def _text_files(p: Probe, tmp: Path, f: Path) -> list[str]:
    return train_cmd(p, tmp, "data.corpus=null", f"data.text_files=[{f}]",
                  f"data.tokenizer={json.dumps(gpt2_spec(fixture(p, 'tok')))}")


@case("training", "text_file_binary", "a binary `data.text_files` entry")
def _(p, tmp):
    binary_file(tmp / "b.txt")
    return _text_files(p, tmp, tmp / "b.txt")


@case("training", "text_file_empty", "an empty `data.text_files` entry")
def _(p, tmp):
    (tmp / "e.txt").write_text("")
    return _text_files(p, tmp, tmp / "e.txt")


@case("training", "text_file_missing", "a `data.text_files` entry that does not exist")
def _(p, tmp):
    return _text_files(p, tmp, tmp / "none.txt")


@case("training", "corpus_not_a_corpus", "`data.corpus` an empty folder")
def _(p, tmp):
    (tmp / "empty").mkdir()
    return train_cmd(p, tmp, corpus=tmp / "empty")


@case("training", "corpus_json_binary", "a binary corpus.json")
def _(p, tmp):
    c = copy_of(p, "corpus", tmp / "corpus")
    binary_file(c / "corpus.json")
    return train_cmd(p, tmp, corpus=c)


@case("training", "token_ids_out_of_range", "a token id 65000 in the corpus .bin (vocabulary 50257)")
def _(p, tmp):
    return train_cmd(p, tmp, corpus=damage_bin(p, tmp, "out_of_range"))


@case("training", "token_ids_padding_range", "a token id in the model's vocabulary padding (50260)")
def _(p, tmp):
    return train_cmd(p, tmp, corpus=damage_bin(p, tmp, "padding_range"))


@case("training", "bin_truncated", "the corpus .bin cut in half")
def _(p, tmp):
    return train_cmd(p, tmp, corpus=damage_bin(p, tmp, "truncate"))


@case("training", "idx_zeroed", "the corpus .idx zeroed after its header")
def _(p, tmp):
    c = copy_of(p, "corpus", tmp / "corpus")
    idx = next(c.glob("*.idx"))
    raw = bytearray(idx.read_bytes())
    raw[40:] = bytes(len(raw) - 40)
    idx.write_bytes(bytes(raw))
    return train_cmd(p, tmp, corpus=c)
