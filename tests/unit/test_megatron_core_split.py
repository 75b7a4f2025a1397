"""``data.split_convention: megatron_core`` against Megatron-Core 0.16.1's own ``BlendedMegatronDatasetBuilder`` (the
wheel of the test extra, run in-process on our prefixes): the same split documents of every prefix, the same
per-prefix sample counts, the same blend length, order and samples; where Megatron-LM 2021's rules give another
split or other counts, ``megatron_lm`` (the default) still gives them, and the two never share a cached index map
they do not agree on. The rules: ``training/data/split_convention.py``."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_ds_suite.core.errors import ConfigError
from tests.helpers.corpora import EOD, make_gpt_corpus
from tests.helpers.megatron_reference import megatron_core_builder_blend, megatron_core_datasets_dir
from training.data.blending import build_blended_datasets, parse_prefixes
from training.data.gpt_dataset import split_boundaries
from training.data.split_convention import core_split_boundaries, refuse_other_convention

# name: (documents per prefix, raw weights, split, (train, valid, test) samples, seq_length, seed, what megatron_lm
# does differently here: "split" = some prefix's documents, "counts" = some prefix's sample count)
CASES = {
    "969_30_1": ((517, 600), [3, 7], "969,30,1", (2001, 120, 20), 16, 1234, {"split", "counts"}),
    "98_2_0": ((75, 125, 60), [0.2, 0.5, 0.3], "98,2,0", (1500, 100, 0), 16, 7, {"split"}),
    "80_10_10": ((23, 24, 34), [1, 1, 1], "80,10,10", (1000, 100, 20), 8, 99, {"split", "counts"}),
}


def _sample(theirs, i: int) -> list[int]:
    s = theirs[i]
    return np.append(s["tokens"].numpy(), s["labels"].numpy()[-1]).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_convention_is_megatron_cores_builder(case, tmp_path):
    megatron_core_datasets_dir()
    docs, raw, split, sizes, seq, seed, lm_differs = CASES[case]
    prefixes = []
    for j, d in enumerate(docs):
        prefixes.append(tmp_path / f"p{j}")
        make_gpt_corpus(prefixes[-1], d, seed=40 + j)
    pairs = [[w, str(p)] for w, p in zip(raw, prefixes)]
    cache = tmp_path / "cache"  # one cache for both conventions: neither may pick up the other's maps
    lm = build_blended_datasets(*parse_prefixes(pairs), split, sizes, seq, seed, cache, 1000)
    core = build_blended_datasets(*parse_prefixes(pairs, "megatron_core"), split, sizes, seq, seed, cache, 1000,
                                  convention="megatron_core")
    theirs = megatron_core_builder_blend(prefixes, raw, split, sizes, seq, seed, 1000, EOD)
    seen = set()
    for k, name in enumerate(("train", "valid", "test")):
        if sizes[k] == 0:
            assert core[k] is None and (theirs[k] is None or len(theirs[k]) == 0), name
            continue
        ours, mc = core[k], theirs[k]
        assert len(ours) == len(mc) >= sizes[k], name  # Megatron-Core's blend length, sum(ceil(N * w))
        assert np.array_equal(ours.dataset_index, mc.dataset_index), name
        assert np.array_equal(ours.dataset_sample_index, mc.dataset_sample_index), name
        for d, (mine, part) in enumerate(zip(ours.datasets, mc.datasets)):
            assert mine.documents.tolist() == part.indices.tolist(), (name, d)
            assert mine.num_samples == part.num_samples and len(mine) == len(part), (name, d)
            other = lm[k].datasets[d]
            if other.documents.tolist() != mine.documents.tolist():
                seen.add("split")
            if other.num_samples != mine.num_samples:
                seen.add("counts")
            if (other.documents.tolist(), other.num_samples) != (mine.documents.tolist(), mine.num_samples):
                assert other.index_paths(cache)["shuffle"] != mine.index_paths(cache)["shuffle"]  # other names
        for i in range(len(ours)):
            assert _sample(mc, i) == ours[i].tolist(), (name, i)
    assert seen == lm_differs  # the option changes what it claims to change here, and nothing else
    assert any(ds.first_epochs_samples is not None for b in core if b is not None for ds in b.datasets)


def test_split_boundaries_of_the_two_conventions():
    """The documented example (49 documents of 969,30,1: 48/1/0 in Megatron-LM 2021, 47/2/0 in Megatron-Core), a
    zero part, and the default being Megatron-LM's."""
    assert split_boundaries("969,30,1", 49) == [0, 48, 49, 49]
    assert split_boundaries("969,30,1", 49, "megatron_core") == [0, 47, 49, 49]
    assert core_split_boundaries([98, 2, 0], 25) == [0, 24, 25, 25]
    assert split_boundaries("98,2,0", 25) == [0, 25, 25, 25]
    with pytest.raises(ConfigError, match="data.split_convention='core' is not one of megatron_lm | megatron_core"):
        split_boundaries("969,30,1", 49, "core")


def test_the_option_in_the_run_config(tmp_path):
    """Typed and strict (an unknown value is one line), off by default, refused beside data.separate_last_epoch=false,
    and a resumed run keeps its checkpoint's convention."""
    from training.config import load_config

    base = Path(__file__).resolve().parents[2] / "configs" / "gpt2_tiny.yaml"
    assert load_config(base).data.split_convention == "megatron_lm"
    assert load_config(base, ["data.split_convention=megatron_core"]).data.split_convention == "megatron_core"
    with pytest.raises(ConfigError) as e:
        load_config(base, ["data.split_convention=megatron"])
    assert "data.split_convention" in e.value.one_line() and "megatron_core" in e.value.one_line()
    assert "\n" not in e.value.one_line()
    with pytest.raises(ConfigError, match="Megatron-Core always shuffles a short last epoch apart"):
        load_config(base, ["data.split_convention=megatron_core", "data.separate_last_epoch=false"])
    saved = json.loads(json.dumps({"data": {"split": "969,30,1"}}))  # a checkpoint from before the option
    refuse_other_convention(saved, "megatron_lm", "RUN/checkpoints/iter_0000010")
    with pytest.raises(ConfigError, match=r"trained with data.split_convention=megatron_lm but this run sets "
                                          r"megatron_core: resume with data.split_convention=megatron_lm"):
        refuse_other_convention(saved, "megatron_core", "RUN/checkpoints/iter_0000010")
    refuse_other_convention({"data": {"split_convention": "megatron_core"}}, "megatron_core", "x")


def test_the_run_builds_its_data_by_its_convention(tmp_path):
    """``build_datasets`` of a run: ``data.prefixes`` under ``megatron_core`` is the convention's blend (Megatron-Core's
    length and documents), and ``data.text_files`` under it are split by Megatron-Core's boundaries with the short
    last epoch shuffled apart (Megatron-Core always does), unlike the default's."""
    from tests.helpers.distributed import SHARED_DATA
    from training.config import load_config
    from training.data.loader import build_datasets, resolve_sources

    gpt2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
    if not gpt2.is_dir():
        pytest.skip("../shared/data absent (the GPT-2 tokenizer)")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(gpt2 / "gpt2-vocab.json"), "merges_file": str(gpt2 / "gpt2-merges.txt")}
    prefixes = []
    for j, d in enumerate((517, 600)):
        prefixes.append(str(tmp_path / f"p{j}"))
        make_gpt_corpus(Path(prefixes[-1]), d, seed=40 + j)
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"document {k} " + "word " * (k % 7 + 1) for k in range(49)))
    base = Path(__file__).resolve().parents[2] / "configs" / "gpt2_tiny.yaml"
    common = [f"data.tokenizer={json.dumps(spec)}", "data.corpus=null", "model.seq_length=16", "data.split=969,30,1"]
    built = {}
    for convention in ("megatron_lm", "megatron_core"):
        ov = [*common, f"data.split_convention={convention}", f"run.dir={tmp_path / convention}"]
        cfg = load_config(base, [*ov, f"data.prefixes={json.dumps([[3, prefixes[0]], [7, prefixes[1]]])}"])
        train, _, _ = build_datasets(cfg, resolve_sources(cfg), (2001, 120, 20))
        direct = build_blended_datasets(*parse_prefixes(cfg.data.prefixes, convention), "969,30,1", (2001, 120, 20),
                                        16, cfg.train.seed, tmp_path / "direct", 50_257, convention=convention)[0]
        assert np.array_equal(train.dataset_index, direct.dataset_index)
        assert [ds.documents.tolist() for ds in train.datasets] == [ds.documents.tolist() for ds in direct.datasets]
        cfg = load_config(base, [*ov, f"data.text_files=[{text}]"])
        built[convention] = (len(train), build_datasets(cfg, resolve_sources(cfg), (30, 10, 0))[0])
    assert (built["megatron_lm"][0], built["megatron_core"][0]) == (2001, 2002)
    lm, core = built["megatron_lm"][1], built["megatron_core"][1]
    assert (len(lm.documents), len(core.documents)) == (48, 47)  # the documented 49-document example
    assert lm.num_epochs > 1 and lm.first_epochs_samples is None and core.first_epochs_samples is not None


def test_heldout_evaluation_scores_the_part_of_the_runs_convention(tmp_path):
    """``python -m evaluation heldout --split-convention`` (the main job passes the run's): the valid part of
    969,30,1 over 49 documents is document 48 under megatron_lm and documents 47-48 under megatron_core."""
    from evaluation.heldout import heldout_tokens
    from megatron_ds_suite.core.corpus import write_manifest
    from tests.helpers.distributed import SHARED_DATA

    gpt2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
    if not gpt2.is_dir():
        pytest.skip("../shared/data absent (the GPT-2 tokenizer)")
    docs = make_gpt_corpus(tmp_path / "gpt", 49, seed=3)
    write_manifest(tmp_path, {"kind": "gpt2_bpe", "vocab_file": str(gpt2 / "gpt2-vocab.json"),
                              "merges_file": str(gpt2 / "gpt2-merges.txt")}, "gpt", None, {})
    for convention, first in (("megatron_lm", 48), ("megatron_core", 47)):
        stream, used, part = heldout_tokens(tmp_path, "969,30,1", "valid", convention=convention)
        assert (used, part) == (49 - first, 49 - first)
        assert stream.tolist() == np.concatenate(docs[first:]).tolist()
