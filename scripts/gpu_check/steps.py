"""The GPU smoke suite's internal steps, run as their own processes by the checks (``python -m
scripts.gpu_check --prepare-bert-corpus`` / ``--compare-hf``): a sentence-level BERT corpus and the HF export
comparison.
"""
from __future__ import annotations

import json
from pathlib import Path


# --------------------------------------------------------------------------------------------------
# internal steps (run as their own processes by the checks above)
# --------------------------------------------------------------------------------------------------
def prepare_bert_corpus(root: Path, data: Path) -> None:
    """A sentence-level BERT corpus (like ``python -m data_pipeline build ... dataset.bert=true``) from
    Botchan and Tiny Shakespeare, with an 8,000-piece BERT-flavoured sentencepiece vocabulary."""
    import numpy as np

    from data_pipeline.sentences import split_sentences
    from data_pipeline.tokenizer_train import train_sentencepiece
    from megatron_ds_suite.core.corpus import write_manifest
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype

    docs = []
    for name in ("botchan.txt", "tinyshakespeare.txt"):
        lines = (data / "corpus" / name).read_text(encoding="utf-8").lstrip("\ufeff").splitlines()
        docs += [split_sentences(" ".join(x.strip() for x in lines[i:i + 30])) for i in range(0, len(lines), 30)]
    docs = [d for d in docs if len(d) >= 2]
    tok = train_sentencepiece([" ".join(d) for d in docs], root / "tokenizer" / "spm", 8000, flavor="bert",
                              lowercase=True)
    with MMapIndexedDatasetBuilder(root / "sent", best_dtype(tok.vocab_size)) as b:
        for d in docs:
            b.add_document([np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(d) if ids])
    write_manifest(root, tok.spec(), None, "sent", {"source": "gpu_check: botchan + tinyshakespeare"})


def compare_hf(run_dir: Path, hf_dir: Path, data: Path) -> None:
    """Logits of the exported HF model and of ours (fp32, TF32 off) on 512 Tiny Shakespeare tokens."""
    import torch
    from transformers import GPT2LMHeadModel

    from training.checkpoint_reader import load_model_for_eval

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours, cfg, tok = load_model_for_eval(run_dir, device="cuda")
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).cuda().eval()
    text = (data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:4000]
    ids = torch.tensor([tok.encode(text)[:cfg.model.seq_length]], device="cuda")
    with torch.no_grad():
        a = ours(ids)[..., :tok.vocab_size].float()
        b = hf(ids).logits.float()
    res = {"max_abs_diff": float((a - b).abs().max()), "tokens": int(ids.numel())}
    (hf_dir / "compare.json").write_text(json.dumps(res))
