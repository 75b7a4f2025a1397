"""Model presets: the Megatron-LM paper's configurations (Shoeybi et al. 2019, Tables 1 and 4)."""
from __future__ import annotations

from typing import Any

from megatron_ds_suite.core.errors import ConfigError
from training.models.config import ModelConfig
from training.plan.accounting import ModelShape

# GPT-2: vocabulary 51,200 = GPT-2's 50,257 padded to a multiple of 1024 (the paper's padding for all
# sizes; 51,200 is also a multiple of 128 x t for t <= 8, so our padding leaves it unchanged).
_GPT2: dict[str, Any] = dict(arch="gpt2", seq_length=1024, vocab_size=51200, make_vocab_size_divisible_by=128)
# BERT: WordPiece 30,522 -> padded by Megatron's rule; seq 512.
_BERT: dict[str, Any] = dict(arch="bert", seq_length=512, vocab_size=30522, make_vocab_size_divisible_by=128)
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-1.2b": {**_GPT2, "hidden_size": 1536, "num_layers": 40, "num_attention_heads": 16},
    "gpt2-2.5b": {**_GPT2, "hidden_size": 1920, "num_layers": 54, "num_attention_heads": 20},
    "gpt2-4.2b": {**_GPT2, "hidden_size": 2304, "num_layers": 64, "num_attention_heads": 24},
    "gpt2-8.3b": {**_GPT2, "hidden_size": 3072, "num_layers": 72, "num_attention_heads": 32},
    "bert-336m": {**_BERT, "hidden_size": 1024, "num_layers": 24, "num_attention_heads": 16},
    "bert-1.3b": {**_BERT, "hidden_size": 2048, "num_layers": 24, "num_attention_heads": 32},
    "bert-3.9b": {**_BERT, "hidden_size": 2560, "num_layers": 48, "num_attention_heads": 40},
}


def preset_shape(name: str, tp: int = 1) -> ModelShape:
    """The shape of preset ``name`` with the vocabulary padded for TP degree ``tp``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(PRESETS)}")
    return ModelShape.from_config(ModelConfig(**PRESETS[name]), tp)

