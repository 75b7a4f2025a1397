"""BERT <-> ``transformers``: one name map for import (:mod:`training.tools.import_hf`) and export (:mod:`training.tools.export_hf`).

Our two layer orders are exactly two ``transformers`` classes:

* ``model.layer_order: pre_ln`` (Megatron's rearranged order, Figure 7) = ``MegatronBertForPreTraining``:
  LayerNorm before attention (``attention.ln``) and before the MLP (``layer.i.ln``), a final
  ``encoder.ln``, no LayerNorm on the embeddings.
* ``post_ln`` (original BERT) = ``BertForPreTraining``: ``embeddings.LayerNorm``, then
  ``attention.output.LayerNorm`` and ``output.LayerNorm`` after each residual.

Both: word/position/token-type embeddings, Q, K, V as three ``[h, h]`` linears (ours: one ``[3h, h]``
with rows [Q; K; V]), attention output, MLP, pooler (tanh), MLM head (dense -> GeLU -> LayerNorm ->
decoder tied to the word embedding + bias) and the 2-way head (``cls.seq_relationship``; ours is
sentence-order prediction, the same shape as next-sentence prediction).
"""
from __future__ import annotations

import torch

from megatron_ds_suite.core.errors import SuiteError
from training.models.config import ModelConfig
from training.parallel.sharding import is_vocab_sized, resize_vocab_rows
from training.tools.hf_interop import check_config

ACTS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}


class BertMappingError(SuiteError):
    """A BERT config or state dict that does not map (one line)."""


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) for every tensor except the fused QKV (handled separately)."""
    pre = cfg.layer_order == "pre_ln"
    out = [("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
           ("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight")]
    if cfg.num_tokentypes > 0:
        out.append(("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"))
    lns = [("final_ln", "bert.encoder.ln")] if pre else [("embedding_ln", "bert.embeddings.LayerNorm")]
    for i in range(cfg.num_layers):
        a, h = f"layers.{i}.", f"bert.encoder.layer.{i}."
        ln1, ln2 = ("attention.ln", "ln") if pre else ("attention.output.LayerNorm", "output.LayerNorm")
        lns += [(a + "ln1", h + ln1), (a + "ln2", h + ln2)]
        for ours, theirs in (("attn.proj", "attention.output.dense"), ("mlp.fc", "intermediate.dense"),
                             ("mlp.proj", "output.dense")):
            out += [(a + ours + ".weight", h + theirs + ".weight"), (a + ours + ".bias", h + theirs + ".bias")]
    lns += [("lm_head.ln", "cls.predictions.transform.LayerNorm")]
    for ours, theirs in lns:
        out += [(ours + ".weight", theirs + ".weight"), (ours + ".bias", theirs + ".bias")]
    out += [("lm_head.dense.weight", "cls.predictions.transform.dense.weight"),
            ("lm_head.dense.bias", "cls.predictions.transform.dense.bias"),
            ("lm_head.bias", "cls.predictions.bias")]
    if cfg.binary_head:
        out += [("pooler.weight", "bert.pooler.dense.weight"), ("pooler.bias", "bert.pooler.dense.bias"),
                ("binary_head.weight", "cls.seq_relationship.weight"), ("binary_head.bias", "cls.seq_relationship.bias")]
    return out


def model_config_from_hf(hf_cfg, seq_length: int | None = None) -> ModelConfig:
    """Our BERT ModelConfig for a ``MegatronBertConfig`` (pre_ln) or ``BertConfig`` (post_ln)."""
    check_config(hf_cfg, counts=("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                                 "max_position_embeddings", "vocab_size", "type_vocab_size"),
                 probabilities=("hidden_dropout_prob", "attention_probs_dropout_prob"),
                 positives=("layer_norm_eps", "initializer_range"))
    act = ACTS.get(hf_cfg.hidden_act) if isinstance(hf_cfg.hidden_act, str) else None
    if act is None:
        raise BertMappingError(f"hidden_act={hf_cfg.hidden_act!r} is not supported (gelu, gelu_new)")
    if getattr(hf_cfg, "position_embedding_type", "absolute") != "absolute":
        raise BertMappingError(f"position_embedding_type={hf_cfg.position_embedding_type!r}: only absolute positions")
    positions = hf_cfg.max_position_embeddings
    seq = seq_length or min(positions, 512)
    if seq > positions:
        raise BertMappingError(f"--seq-length {seq} exceeds max_position_embeddings {positions}")
    return ModelConfig(arch="bert", num_layers=hf_cfg.num_hidden_layers, hidden_size=hf_cfg.hidden_size,
                       num_attention_heads=hf_cfg.num_attention_heads, seq_length=seq, max_position_embeddings=positions,
                       vocab_size=hf_cfg.vocab_size, ffn_hidden_size=hf_cfg.intermediate_size,
                       hidden_dropout=float(hf_cfg.hidden_dropout_prob),
                       attention_dropout=float(hf_cfg.attention_probs_dropout_prob),
                       init_method_std=float(hf_cfg.initializer_range), layernorm_epsilon=float(hf_cfg.layer_norm_eps),
                       activation=act, layer_order="pre_ln" if hf_cfg.model_type == "megatron-bert" else "post_ln",
                       num_tokentypes=hf_cfg.type_vocab_size, binary_head=True)


def hf_config(cfg: ModelConfig, vocab_size: int):
    """The transformers config of our BERT (MegatronBertConfig for pre_ln, BertConfig for post_ln)."""
    from transformers import BertConfig, MegatronBertConfig

    cls = MegatronBertConfig if cfg.layer_order == "pre_ln" else BertConfig
    return cls(vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_size, hidden_act=cfg.activation,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=cfg.positions,
               type_vocab_size=max(cfg.num_tokentypes, 1), initializer_range=cfg.init_method_std,
               layer_norm_eps=cfg.layernorm_epsilon, tie_word_embeddings=True,
               architectures=["MegatronBertForPreTraining" if cfg.layer_order == "pre_ln" else "BertForPreTraining"])


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF ``*ForPreTraining`` state dict -> our TP=1 BertModel names (vocabulary not padded)."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise BertMappingError(f"the source weights lack {name!r}: not a {cfg.layer_order} BERT for pretraining")
        return hf[name].detach().to(torch.float32).cpu().contiguous()

    dec = hf.get("cls.predictions.decoder.weight")
    if dec is not None and not torch.equal(dec.float().cpu(), get("bert.embeddings.word_embeddings.weight")):
        raise BertMappingError("cls.predictions.decoder.weight differs from the word embedding: untied heads do not import")
    out = {ours: get(theirs) for ours, theirs in _pairs(cfg)}
    for i in range(cfg.num_layers):
        h = f"bert.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            out[f"layers.{i}.attn.qkv.{kind}"] = torch.cat([get(h + p + "." + kind) for p in ("query", "key", "value")])
    return out


def to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our merged BertModel state dict -> HF names (vocabulary padding rows dropped)."""
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise BertMappingError(f"checkpoint lacks {name!r}: not a BERT pretraining model of this project")
        t = sd[name].detach().to(torch.float32).cpu()
        return resize_vocab_rows(t, vocab_size).clone() if is_vocab_sized(name) else t

    out = {theirs: get(ours) for ours, theirs in _pairs(cfg)}
    h = cfg.hidden_size
    for i in range(cfg.num_layers):
        qkv_w, qkv_b = get(f"layers.{i}.attn.qkv.weight"), get(f"layers.{i}.attn.qkv.bias")
        for k, p in enumerate(("query", "key", "value")):
            out[f"bert.encoder.layer.{i}.attention.self.{p}.weight"] = qkv_w[k * h:(k + 1) * h].clone()
            out[f"bert.encoder.layer.{i}.attention.self.{p}.bias"] = qkv_b[k * h:(k + 1) * h].clone()
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def build_hf_bert(sd: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int):
    """A transformers ``*ForPreTraining`` holding our weights (every HF tensor provided)."""
    from transformers import BertForPreTraining, MegatronBertForPreTraining

    if cfg.head != "pretrain" or not cfg.binary_head:
        raise BertMappingError("only BERT pretraining checkpoints with the binary (SOP) head export "
                               f"(this one: head={cfg.head}, binary_head={cfg.binary_head})")
    if cfg.num_tokentypes < 1:
        raise BertMappingError("a BERT without token-type embeddings does not map to transformers' BERT")
    if cfg.lm_head_activation not in (None, cfg.activation):
        raise BertMappingError(f"the MLM head's GeLU ({cfg.lm_head_activation}) is not the MLP's ({cfg.activation}): "
                               f"transformers' BERT has one hidden_act for both")
    cls = MegatronBertForPreTraining if cfg.layer_order == "pre_ln" else BertForPreTraining
    model = cls(hf_config(cfg, vocab_size))
    theirs = to_hf(sd, cfg, vocab_size)
    missing, unexpected = model.load_state_dict(theirs, strict=False)
    missing = [m for m in missing if "position_ids" not in m and "token_type_ids" not in m]
    if missing or unexpected:
        raise BertMappingError(f"weight mapping mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()
