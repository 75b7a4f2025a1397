"""BERT both ways: random transformers MegatronBertForPreTraining (our pre_ln order) and BertForPreTraining
(post_ln) of an odd shape with a WordPiece vocab.txt import at TP=1 and TP=2 with MLM and 2-way logits equal
to transformers' (1e-5 fp32), and export(import(x)) == x tensor for tensor, tokenizer included."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import SHARED_DATA

pytest.importorskip("transformers")
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    from tokenizers import BertWordPieceTokenizer

    if not BOTCHAN.is_file():
        pytest.skip("botchan.txt absent")
    d = tmp_path_factory.mktemp("bert_vocab")
    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train([str(BOTCHAN)], vocab_size=2000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                  show_progress=False)
    trainer.save_model(str(d))
    return d


def _save_random_bert(folder: Path, vocab_dir: Path, cls_name: str) -> int:
    import transformers
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(str(vocab_dir), do_lower_case=True)
    config_cls = transformers.MegatronBertConfig if cls_name.startswith("Megatron") else transformers.BertConfig
    cfg = config_cls(vocab_size=len(tok), hidden_size=96, num_hidden_layers=3, num_attention_heads=6,
                     intermediate_size=384, max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or ".ln." in name or name.endswith(".ln.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    (folder / "vocab.txt").write_bytes((vocab_dir / "vocab.txt").read_bytes())  # as hub BERT folders have it
    return len(tok)


@pytest.mark.parametrize("cls_name,order", [("MegatronBertForPreTraining", "pre_ln"), ("BertForPreTraining", "post_ln")])
def test_bert_import_equals_transformers_and_exports_back(vocab_dir, tmp_path, cls_name, order):
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from training.checkpoint_reader import load_merged_state_dict, load_model_for_eval
    from training.tools.export_hf import export
    from training.tools.import_hf import import_hf

    src = tmp_path / "src"
    V = _save_random_bert(src, vocab_dir, cls_name)
    hf = getattr(transformers, cls_name).from_pretrained(str(src)).eval()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(5, V, (2, 24), generator=g)
    types = torch.cat([torch.zeros(2, 12, dtype=torch.long), torch.ones(2, 12, dtype=torch.long)], 1)
    pad = torch.ones(2, 24, dtype=torch.long)
    pad[1, 18:] = 0
    with torch.no_grad():
        ref = hf(input_ids=tokens, token_type_ids=types, attention_mask=pad)
    # TP 1, TP 2, and TP 2 x PP 2 (the pipeline's layer files: training.models.bert_pipe's layout)
    runs = {(tp, pp): import_hf(str(src), tmp_path / f"tp{tp}pp{pp}", tp=tp, pp=pp) for tp, pp in ((1, 1), (2, 1), (2, 2))}
    merged = {}
    for (tp, pp), run in runs.items():
        model, cfg, tok = load_model_for_eval(run)
        assert (cfg.model.arch, cfg.model.layer_order, cfg.model.activation, tok.kind) == ("bert", order, "gelu", "wordpiece")
        with torch.no_grad():
            logits, sop = model(tokens, types, pad)
        keep = pad.bool()  # padded positions are not compared (their values depend on masking conventions)
        torch.testing.assert_close(logits[..., :V][keep], ref.prediction_logits[keep], rtol=0, atol=1e-5)
        torch.testing.assert_close(sop, ref.seq_relationship_logits, rtol=0, atol=1e-5)
        sd, _, meta = load_merged_state_dict(run)
        assert meta["padded_vocab_size"] == 128 * tp * -(-V // (128 * tp))
        merged[tp, pp] = {k: (v[:V] if k.endswith(("word_embeddings.weight", "lm_head.bias")) else v)
                          for k, v in sd.items()}
    assert sorted(merged[2, 2]) == sorted(merged[1, 1])
    for name, w in merged[1, 1].items():
        assert torch.equal(merged[2, 1][name], w) and torch.equal(merged[2, 2][name], w), name

    out = export(runs[2, 2], tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    skip = ("position_ids", "token_type_ids")
    a = {k: v for k, v in a.items() if not k.endswith(skip)}
    b = {k: v for k, v in b.items() if not k.endswith(skip)}
    assert set(a) <= set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    text = BOTCHAN.read_text(encoding="utf-8")[:3000]
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == AutoTokenizer.from_pretrained(str(src))(text)["input_ids"]
    # the plain vocab.txt too (transformers 5 writes tokenizer.json only): BERT tools that read it get the same ids
    from transformers import BertTokenizer

    assert (out / "vocab.txt").read_bytes() == (vocab_dir / "vocab.txt").read_bytes()
    slow = BertTokenizer(str(out / "vocab.txt"), do_lower_case=True)
    assert slow(text)["input_ids"] == AutoTokenizer.from_pretrained(str(src))(text)["input_ids"]
