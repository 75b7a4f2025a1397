"""Tokenization throughput of the corpus builder's single tokenization (the filter stage), one process.

The generated corpus of ``bench_corpus --e2e-docs`` (~300-word documents from a word-bigram chain over
botchan + tinyshakespeare), a SentencePiece BPE model trained on it as the build trains one (GPT flavour,
``--vocab``), then, in batches of ``--batch`` documents as the filter sends them:

* ``SentencePieceProcessor.Encode`` (the library's batch API);
* the project's word cache (``megatron_ds_suite.core.spm_words``, what ``SentencePieceTokenizer`` uses), from
  an empty cache (``cold``: a fresh worker's first documents) and again over the same documents (``warm``);
* GPT-2 BPE (other ids), when ``../shared/data/tokenizers/gpt2`` is there: the Rust ``tokenizers`` library's
  ``encode_batch_fast`` (multi-threaded) on whole texts, and the same tokenizer through the word cache
  (what ``GPT2BPETokenizer.encode_batch`` / ``encode_flat`` use for ASCII texts), warm.

Every word-cache variant's ids are checked equal to its library's. Reports CPU seconds (this process: the
measurement runs on one core) and MB/s, median of ``--reps`` interleaved repetitions::

    .venv/bin/python -m benchmarks.bench_tokenize --docs 6000 --reps 3
"""
from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.bench_corpus import DATA, markov_corpus, real_words
from data_pipeline.tokenizer_train import train_sentencepiece
from megatron_ds_suite.core.spm_words import WordCachedEncoder
from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=6000)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    info = common.machine_info()
    texts = markov_corpus(real_words([DATA / "botchan.txt", DATA / "tinyshakespeare.txt"]), args.docs)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        sp = train_sentencepiece(texts, Path(tmp) / "spm", args.vocab).processor
    batches = [texts[s:s + args.batch] for s in range(0, len(texts), args.batch)]
    expect = [list(x) for b in batches for x in sp.Encode(b, out_type=int)]
    flat_expect = [i for x in expect for i in x]
    gpt2_dir = DATA.parent / "tokenizers" / "gpt2"
    gpt2 = (GPT2BPETokenizer(gpt2_dir / "gpt2-vocab.json", gpt2_dir / "gpt2-merges.txt")
            if (gpt2_dir / "gpt2-vocab.json").is_file() else None)

    def sentencepiece() -> list[int]:
        return [i for b in batches for x in sp.Encode(b, out_type=int) for i in x]

    def cached(enc: WordCachedEncoder) -> list[int]:
        return [i for b in batches for i in enc.encode_flat(b)[0].tolist()]

    secs: dict[str, list[float]] = {"SentencePiece Encode": [], "word cache, cold": [], "word cache, warm": []}
    if gpt2 is not None:
        secs["GPT-2 BPE, tokenizers library"] = []
        secs["GPT-2 BPE, word cache, warm"] = []
        gpt2_expect = [i for b in batches for x in gpt2._encode_many(b) for i in x]
    for _ in range(args.reps):
        c = cpu()
        assert sentencepiece() == flat_expect
        secs["SentencePiece Encode"].append(cpu() - c)
        enc = WordCachedEncoder(sp)
        for name in ("word cache, cold", "word cache, warm"):
            c = cpu()
            got = cached(enc)
            secs[name].append(cpu() - c)
            assert got == flat_expect, f"{name}: ids differ from SentencePiece's"
        if gpt2 is not None:
            c = cpu()
            got = [i for b in batches for x in gpt2._encode_many(b) for i in x]
            secs["GPT-2 BPE, tokenizers library"].append(cpu() - c)
            [gpt2.encode_flat(b) for b in batches]  # warm the cache
            c = cpu()
            got = [i for b in batches for i in gpt2.encode_flat(b)[0].tolist()]
            secs["GPT-2 BPE, word cache, warm"].append(cpu() - c)
            assert got == gpt2_expect, "GPT-2 word cache: ids differ from the library's"
    print(common.markdown_header(info, common.load_average()))
    print(f"- {args.docs} documents, {mb:.1f} MB, SentencePiece BPE {args.vocab} (GPT flavour), batches of "
          f"{args.batch}; CPU seconds of this process, median of {args.reps}; ids equal to SentencePiece's: yes "
          f"(asserted); words cached after one pass: {enc.cached_words:,}")
    print()
    ref = statistics.median(secs["SentencePiece Encode"])
    rows = [[name, f"{statistics.median(v):.3f}", f"{min(v):.3f}-{max(v):.3f}", f"{mb / statistics.median(v):.1f}",
             f"{ref / statistics.median(v):.2f}x"] for name, v in secs.items()]
    print(common.markdown_table(["tokenizer", "CPU s (median)", "min-max", "MB per CPU-second",
                                 "vs SentencePiece Encode"], rows))


if __name__ == "__main__":
    main()
