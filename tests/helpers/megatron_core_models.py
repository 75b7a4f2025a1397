"""Megatron-Core's own models on the CPU for the interop tests (tests/parallel/test_import_megatron.py,
tests/parallel/test_torch_dist.py): GPT-2, the Llama shape and BERT at TP = the gloo world, with seeded noise on every
parameter, their gathered logits, and the ``args`` Megatron-LM saves (shims: see test_import_megatron's docstring)."""
from __future__ import annotations

import argparse
import contextlib
import types
import zlib
from pathlib import Path

import torch

from tests.helpers.distributed import SHARED_DATA

GPT2_DIR = Path(SHARED_DATA) / "tokenizers" / "gpt2"
H, N, L, F, POS, S = 32, 4, 2, 64, 24, 12
G, ROPE_BASE = 2, 5000  # the Llama shape's key/value groups and RoPE base


def noise(name: str, rank: int, sharded: bool, shape) -> torch.Tensor:
    seed = zlib.crc32(name.encode()) + (1000 * rank if sharded else 0)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.2


def megatron_model(arch: str, world: int, padded: int):
    """Megatron-Core's model of ``arch`` at TP=world on the CPU (model parallelism initialised already; see the module
    docstring for the CPU shims)."""
    import torch.nn.functional as Fn
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.get_global_memory_buffer = lambda: types.SimpleNamespace(
        get_tensor=lambda shape, dtype, name, **kw: torch.empty(shape, dtype=dtype))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    llama = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=Fn.silu, add_bias_linear=False,
                 num_query_groups=G, bias_activation_fusion=False) if arch == "llama" else {}
    cfg = TransformerConfig(**{**dict(num_layers=L, hidden_size=H, num_attention_heads=N, ffn_hidden_size=F,
                                      use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                      bias_activation_fusion=True, activation_func=Fn.gelu, layernorm_epsilon=1e-5,
                                      tensor_model_parallel_size=world), **llama})
    if arch == "llama":
        torch.cuda.current_device = lambda: "cpu"  # RoPE's inv_freq moves to the "current device" on first use
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded,
                        max_sequence_length=POS, parallel_output=True, share_embeddings_and_output_weights=False,
                        position_embedding_type="rope", rotary_base=ROPE_BASE)
    if arch == "gpt2":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=padded, max_sequence_length=POS,
                        parallel_output=True, share_embeddings_and_output_weights=True)
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(cfg, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec, vocab_size=padded,
                     max_sequence_length=POS, add_binary_head=True, parallel_output=True,
                     share_embeddings_and_output_weights=True)


def megatron_logits(model, arch: str, world: int, tokens, types_, pad):
    """(full logits gathered over the TP ranks, BERT's sentence-order logits or None)."""
    model.eval()
    b, s = tokens.shape
    with torch.no_grad():
        if arch in ("gpt2", "llama"):
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]       # True = masked
            logits, sop = model(tokens, torch.arange(s)[None].expand(b, s), mask), None
        else:
            logits, sop = model(tokens, pad, tokentype_ids=types_)
    parts = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(parts, logits.contiguous())
    return torch.cat(parts, -1), sop


def megatron_worker(rank: int, world: int, arch: str, padded: int, tokens, types_, pad):
    """Megatron-Core's model at TP=world: (full logits, sop logits or None, this rank's state dict)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1234)  # as Megatron's initialize: replicated tensors (positions, norms) equal on every rank
    model = megatron_model(arch, world, padded)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(noise(name, rank, getattr(p, "tensor_model_parallel", False), p.shape))
    logits, sop = megatron_logits(model, arch, world, tokens, types_, pad)
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k}
    return logits, sop, state


def megatron_args(shards: list[dict], arch: str, vocab: int, pp: int, iteration: int, **overrides):
    """The ``args`` Megatron-LM saves, with its argument names and its real enums."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    tp = len(shards)
    args = argparse.Namespace(
        num_layers=L, hidden_size=H, ffn_hidden_size=F, num_attention_heads=N, kv_channels=H // N,
        max_position_embeddings=POS, seq_length=16, make_vocab_size_divisible_by=32,
        padded_vocab_size=shards[0]["embedding.word_embeddings.weight"].size(0) * tp, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bias_gelu_fusion=True, openai_gelu=False,
        onnx_safe=False, swiglu=False, squared_relu=False, apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=False, hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
        position_embedding_type="learned_absolute", normalization="LayerNorm", add_bias_linear=True,
        untie_embeddings_and_output_weights=False, apply_residual_connection_post_layernorm=False,
        group_query_attention=False, num_experts=None, bert_binary_head=arch == "bert", params_dtype=torch.float32,
        tokenizer_type="BertWordPieceLowerCase" if arch == "bert" else "GPT2BPETokenizer",
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto, iteration=iteration,
        transformer_impl="local", vocab_size=vocab)
    vars(args).update(overrides)
    return args


LLAMA_ARGS = dict(position_embedding_type="rope", rotary_base=ROPE_BASE, rotary_percent=1.0, normalization="RMSNorm",
                  swiglu=True, group_query_attention=True, num_query_groups=G, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, bias_gelu_fusion=False)


def inputs(vocab: int):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(5, vocab, (2, S), generator=g)
    types_ = torch.cat([torch.zeros(2, S // 2, dtype=torch.long), torch.ones(2, S // 2, dtype=torch.long)], 1)
    return tokens, types_, torch.ones(2, S, dtype=torch.long)


def write_bert_vocab(path: Path) -> Path:
    """A WordPiece vocab.txt of 300 entries (specials, letters, word pieces) at ``path``."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words += [f"##{chr(c)}" for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(300 - 57)]
    path.write_text("\n".join(words) + "\n")
    return path
