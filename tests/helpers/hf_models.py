"""Random ``transformers`` models saved as local folders (no hub access) for the interop tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.helpers.distributed import SHARED_DATA

GPT2_TOKENIZER = Path(SHARED_DATA) / "tokenizers" / "gpt2"


def save_random_gpt2(folder: Path, seed: int = 0, n_positions: int = 64, n_layer: int = 3, n_embd: int = 96,
                     n_head: int = 6) -> Path:
    """An odd-shaped GPT-2 (by default 3 layers, hidden 96, 6 heads; the real 50,257-id vocabulary, tanh GeLU)
    with every LayerNorm and bias perturbed, saved with the real GPT-2 tokenizer files."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     initializer_range=0.1, activation_function="gelu_new")
    model = GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    shutil.copyfile(GPT2_TOKENIZER / "gpt2-vocab.json", folder / "vocab.json")
    shutil.copyfile(GPT2_TOKENIZER / "gpt2-merges.txt", folder / "merges.txt")
    files = (str(folder / "vocab.json"), str(folder / "merges.txt"))
    try:  # transformers 5: vocab / merges take the file paths
        tok = GPT2TokenizerFast(vocab=files[0], merges=files[1])
    except TypeError:  # transformers 4
        tok = GPT2TokenizerFast(vocab_file=files[0], merges_file=files[1])
    tok.save_pretrained(str(folder))
    return folder


def save_random_llama(folder: Path, seed: int = 0, kv_heads: int = 2, rope_theta: float = 10000.0,
                      tied: bool = False, family: str = "llama", rope_scaling: dict | None = None, **extra) -> Path:
    """An odd-shaped Llama (3 layers, hidden 96, 6 heads in ``kv_heads`` key/value groups, MLP 160, the real
    50,257-id GPT-2 vocabulary) with every weight random (RMSNorm weights too), saved with the GPT-2 tokenizer
    as ``tokenizer.json``. ``family``: ``llama``, ``mistral`` or ``qwen2`` (the same block; ``extra`` goes to its
    config, e.g. Mistral's ``sliding_window``). ``rope_scaling``: e.g. llama3's keys, added to ``rope_parameters``."""
    import transformers
    from transformers import GPT2TokenizerFast

    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "mistral": ("MistralConfig", "MistralForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(
        vocab_size=50257, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}, tie_word_embeddings=tied,
        bos_token_id=50256, eos_token_id=50256, **extra)
    model = getattr(transformers, model_class)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    files = (str(GPT2_TOKENIZER / "gpt2-vocab.json"), str(GPT2_TOKENIZER / "gpt2-merges.txt"))
    try:  # transformers 5: vocab / merges take the file paths
        tok = GPT2TokenizerFast(vocab=files[0], merges=files[1])
    except TypeError:  # transformers 4
        tok = GPT2TokenizerFast(vocab_file=files[0], merges_file=files[1])
    tok.save_pretrained(str(folder))
    for name in ("vocab.json", "merges.txt"):  # tokenizer.json only, as Llama folders have
        (folder / name).unlink(missing_ok=True)
    if family != "llama":  # AutoTokenizer would pick the family's own class (Qwen2's splits digits): GPT-2's file as is
        tc = folder / "tokenizer_config.json"
        tc.write_text(json.dumps({**json.loads(tc.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder
