"""training.tools.import_hf: a random transformers GPT-2 of an odd shape becomes our checkpoint at TP=1, TP=2 and
PP=2 with logits equal to transformers', export(import(x)) == x, and train.init_from starts a run from it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import SHARED_DATA, run_distributed
from tests.helpers.hf_models import GPT2_TOKENIZER

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
V = 50257


@pytest.fixture(scope="module")
def source(random_gpt2):
    return random_gpt2[0]


@pytest.fixture(scope="module")
def imported(random_gpt2, tmp_path_factory):
    from training.tools.import_hf import import_hf

    src, tp1 = random_gpt2
    root = tmp_path_factory.mktemp("imported")
    return {(1, 1): tp1, **{(tp, pp): import_hf(str(src), root / f"tp{tp}pp{pp}", tp=tp, pp=pp)
                            for tp, pp in [(2, 1), (1, 2)]}}


def _tokens(n=2, s=40, seed=0):
    return torch.randint(0, V, (n, s), generator=torch.Generator().manual_seed(seed))


def test_import_reproduces_transformers_logits_and_config(source, imported):
    from transformers import GPT2LMHeadModel

    from training.checkpoint_reader import load_merged_state_dict, load_model_for_eval, read_client_state

    hf = GPT2LMHeadModel.from_pretrained(str(source)).eval()
    x = _tokens()
    with torch.no_grad():
        ref = hf(x).logits
    merged = {}
    for (tp, pp), run in imported.items():
        meta = read_client_state(run)
        assert meta["parallel"] == {"tp": tp, "pp": pp, "dp": 1}
        assert meta["padded_vocab_size"] == {1: 50304, 2: 50432}[tp]  # Megatron's padding rule
        n_files = len(list((run / "checkpoints" / "iter_0000000").glob("mp_rank_*_model_states.pt")))
        assert n_files == tp * pp
        if pp > 1:
            assert len(list((run / "checkpoints" / "iter_0000000").glob("layer_*-model_00-model_states.pt"))) == 3 + 2
        model, cfg, tok = load_model_for_eval(run)
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_size, m.positions, m.vocab_size,
                m.activation, m.layernorm_epsilon) == (3, 96, 6, 384, 64, V, "gelu_new", 1e-5)
        assert tok.vocab_size == V and tok.encode("Hello world") == [15496, 995]
        with torch.no_grad():
            ours = model(x)[..., :V]
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
        sd, _, _ = load_merged_state_dict(run)
        merged[(tp, pp)] = {k: (v[:V] if k.endswith("word_embeddings.weight") else v) for k, v in sd.items()}
        assert not sd["embedding.word_embeddings.weight"][V:].any()  # padding rows are zero
    for key in [(2, 1), (1, 2)]:  # every layout holds exactly the same weights
        assert merged[key].keys() == merged[(1, 1)].keys()
        for name, w in merged[(1, 1)].items():
            assert torch.equal(merged[key][name], w), (key, name)


def test_the_tp2_shards_are_megatron_slices(source, imported):
    """TP=2 files hold what a TP=2 GPTModel's parameters are: QKV by heads (stride 3), MLP columns/rows."""
    run = imported[(2, 1)]
    folder = run / "checkpoints" / "iter_0000000"
    r0 = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    r1 = torch.load(folder / "mp_rank_01_model_states.pt", weights_only=True)["module"]
    from safetensors.torch import load_file

    hf = load_file(str(source / "model.safetensors"))
    qkv = hf["transformer.h.1.attn.c_attn.weight"].t()                    # [3h, h] rows [Q; K; V]
    q, k, v = qkv.chunk(3)
    assert torch.equal(r1["layers.1.attn.qkv.weight"], torch.cat([q[48:], k[48:], v[48:]]))  # heads 3..5
    assert torch.equal(r0["layers.1.mlp.fc.weight"], hf["transformer.h.1.mlp.c_fc.weight"].t()[:192])
    assert torch.equal(r1["layers.1.mlp.proj.weight"], hf["transformer.h.1.mlp.c_proj.weight"].t()[:, 192:])
    assert torch.equal(r1["embedding.word_embeddings.weight"][:V - 25216], hf["transformer.wte.weight"][25216:])
    assert torch.equal(r0["layers.2.ln1.bias"], r1["layers.2.ln1.bias"])  # replicated


def test_export_of_import_equals_source(source, imported, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from training.tools.export_hf import export

    out = export(imported[(2, 1)], tmp_path / "back")
    a, b = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    a = {k: v for k, v in a.items() if not k.endswith(".attn.bias")}
    b = {k: v for k, v in b.items() if not k.endswith(".attn.bias")}
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_new" and cfg["n_layer"] == 3 and cfg["vocab_size"] == V
    text = BOTCHAN.read_text(encoding="utf-8")[:2000] if BOTCHAN.is_file() else "Hello world"
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(source))(text)["input_ids"]


def test_bad_inputs_fail_with_one_line(source, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    cmd = [sys.executable, "-m", "training.tools.import_hf", "--model", "gpt2", "--out", str(tmp_path / "x")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert err[0].startswith("error: --model gpt2 is not a local folder") and "--local-dir" in err[0]
    assert not (tmp_path / "x").exists()

    from training.config import ConfigError
    from training.tools.import_hf import ImportHFError, import_hf

    with pytest.raises(ConfigError, match="parallel.tensor=4 does not divide model.num_attention_heads=6"):
        import_hf(str(source), tmp_path / "y", tp=4)
    assert not (tmp_path / "y").exists()
    cfg = json.loads((source / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(ImportHFError, match="activation_function='relu'"):
        import_hf(str(bad), tmp_path / "z")

    # damaged weights (a download cut short): one line naming the reader's complaint, nothing written
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(source, cut)
    (weights,) = cut.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(ImportHFError, match="cannot load the weights .*SafetensorError.*damaged or incomplete"):
        import_hf(str(cut), tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_gpt2_folder_with_only_tokenizer_json_imports(source, imported, tmp_path):
    """What ``save_pretrained`` of the pinned transformers writes for a GPT-2 tokenizer (``tokenizer.json``, no
    vocab.json / merges.txt) imports: vocabulary and merges read from the JSON, the same ids as transformers and
    as the folder with the original files; a non-BPE tokenizer.json is one ImportHFError line."""
    import shutil

    from transformers import AutoTokenizer

    from training.tools.import_hf import ImportHFError, import_hf, import_tokenizer

    folder = tmp_path / "only_json"
    folder.mkdir()
    for f in source.iterdir():
        if f.name not in ("vocab.json", "merges.txt"):
            shutil.copyfile(f, folder / f.name)
    AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(str(folder / "resaved"))
    for f in ("vocab.json", "merges.txt"):
        (folder / "resaved" / f).unlink(missing_ok=True)
    for f in (folder / "resaved").iterdir():
        shutil.copyfile(f, folder / f.name)
    assert (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").exists()
    out = import_hf(str(folder), tmp_path / "run")
    text = "Hello world, it's 2024!\n  Ünïcödé\ttabs and   spaces. The quick brown fox."
    ours, _ = import_tokenizer(folder, tmp_path / "a" / "tokenizer", "gpt2")  # spec paths: RUN/tokenizer/...
    ref, _ = import_tokenizer(source, tmp_path / "b" / "tokenizer", "gpt2")
    assert ours.encode(text) == ref.encode(text) == AutoTokenizer.from_pretrained(str(source))(text)["input_ids"]
    assert (out / "tokenizer" / "merges.txt").is_file()

    wordpiece = tmp_path / "wordpiece"
    wordpiece.mkdir()
    (wordpiece / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}},
                                                          "pre_tokenizer": {"type": "BertPreTokenizer"}}))
    with pytest.raises(ImportHFError, match="is a WordPiece tokenizer, not GPT-2's byte-level BPE"):
        import_tokenizer(wordpiece, tmp_path / "c" / "tokenizer", "gpt2")


# --------------------------------------------------------------------------------------------------
# train.init_from
# --------------------------------------------------------------------------------------------------
def _init_from_run(rank, world, overrides):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides)
    trainer = Trainer(resolve_run(cfg))
    batch = [b for b in trainer.task.micro_batches(0)]
    lr0 = float(trainer.engine.get_lr()[0])
    out = trainer.train()
    lr1 = float(trainer.engine.get_lr()[0])  # the rate of the next update
    return {"batch": batch, "loss": out["last"]["loss"], "lr0": lr0, "lr1": lr1, "model": cfg.model.__dict__.copy(),
            "iteration": trainer.iteration}


def test_init_from_starts_a_tp2_run_from_imported_weights(source, imported, tmp_path):
    """A 1-step TP=2 run (config of another shape) from the TP=1 import: its first loss is the source
    model's loss on the same batch, with a fresh schedule (first warmup step) and iteration 1 after it."""
    if not BOTCHAN.is_file():
        pytest.skip("botchan.txt absent")
    from transformers import GPT2LMHeadModel

    spec = {"kind": "gpt2_bpe", "vocab_file": str((GPT2_TOKENIZER / "gpt2-vocab.json").resolve()),
            "merges_file": str((GPT2_TOKENIZER / "gpt2-merges.txt").resolve())}
    ov = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]", "data.tokenizer": json.dumps(spec),
          "run.dir": str(tmp_path / "run"), "train.progress_bar": "false", "model.seq_length": "32",
          "model.hidden_dropout": "0", "model.attention_dropout": "0", "train.micro_batch_size": "2",
          "train.global_batch_size": "2", "train.iters": "1", "optimizer.warmup_iters": "4",
          "optimizer.decay_iters": "10",
          "parallel.tensor": "2", "train.init_from": str(imported[(1, 1)])}
    res = run_distributed(_init_from_run, 2, [f"{k}={v}" for k, v in ov.items()])[0]
    m = res["model"]
    assert (m["num_layers"], m["hidden_size"], m["activation"], m["vocab_size"]) == (3, 96, "gelu_new", V)
    # fresh schedule, Megatron's warmup (issue 15): the first update runs at lr 0, the next at 1/4 of the peak
    assert res["lr0"] == 0.0 and res["lr1"] == pytest.approx(1e-3 / 4) and res["iteration"] == 1
    (tokens, labels), = res["batch"]
    hf = GPT2LMHeadModel.from_pretrained(str(source)).eval()
    with torch.no_grad():
        logits = hf(tokens).logits
    # Megatron's loss: the zero vocabulary-padding rows (50,432 at TP=2) take part in the softmax with logit 0
    logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], 50432 - V)], dim=-1)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 50432), labels.reshape(-1)).item()
    assert res["loss"] == pytest.approx(ref, abs=1e-5)

    from megatron_ds_suite.core.errors import ConfigError
    from training.checkpoint_reader import read_client_state
    from training.config import load_config, validate_static
    from training.resolve import adopt_model_config

    assert read_client_state(tmp_path / "run")["iteration"] == 1
    bad = load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"{k}={v}" for k, v in {**ov, "parallel.tensor": "4"}.items()])
    adopt_model_config(bad)  # the source's 6 heads; the one validation of resolve_run then refuses TP=4
    with pytest.raises(ConfigError, match="parallel.tensor=4 does not divide model.num_attention_heads=6"):
        validate_static(bad)
