"""Parameter and FLOP accounting of our GPT-2 / BERT: the one place these formulas live.

The planner (memory, communication and step time) and the trainer's MFU (``training.metrics``) both
count with these functions, so the two can not drift apart.

* Parameters of every TP/PP shard, exactly as our models build them (pre-LN layers, MLP of width f
  with biases, learned positions, tied output embedding, padded vocabulary, final LayerNorm; BERT adds
  token types, pooler, LM-head dense+LN+bias and the binary head).
* FLOPs (Narayanan et al. 2021, eq. 3): a matmul [n, k] x [k, j] costs 2 n k j; backward computes the
  gradients of both operands, so forward + backward = 3 x forward; full activation checkpointing runs
  the transformer layers' forward once more (hardware FLOPs, 4 x), which MFU does not credit.

Notation: l layers, h hidden, a heads, s sequence, f MLP width (4h), V padded vocabulary, P positions,
B sequences per step, t/p = TP/PP degrees, m = BERT's masked (predicted) positions per sequence.

Llama-family blocks (``training.models.config.ModelConfig``): grouped-query attention with g key/value heads shrinks
the K and V projections to ``k = g h / a`` rows each (QKV [h + 2k, h]); SwiGLU has three h x f matrices
(gate, up, down) instead of two; an untied output layer adds V x h; RoPE has no position table; RMSNorm has
a weight and no bias (h instead of 2h); ``add_bias_linear: false`` drops the four linears' biases.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ds_suite.core.errors import ConfigError
from training.config import BertDataConfig, Config
from training.models.config import ModelConfig, padded_vocab_size, stage_layers


# --------------------------------------------------------------------------------------------------
# The model's shape
# --------------------------------------------------------------------------------------------------
def bert_expected_masked_positions(masked_lm_prob: float, short_seq_prob: float, seq: int) -> float:
    """Expected number of masked (predicted) positions of one BERT pretraining sequence of length ``seq``.

    ``training.data.bert_data.mask_tokens`` masks ``max(1, round(masked_lm_prob * n))`` tokens, capped at
    ``masked_lm_prob`` x the sample's target length (Megatron's float cap), of a sample of ``n`` real
    tokens (whole-word spans may stop short of it; none when ``masked_lm_prob`` is 0). ``n`` is
    random per sample (``build_samples_mapping``): ``seq`` with probability ``1 - short_seq_prob``, else a
    target uniform in [2, seq - 3] plus [CLS]/[SEP]/[SEP], mean ``(seq + 5) / 2``. So

        E[m] = masked_lm_prob * ((1 - short_seq_prob) * seq + short_seq_prob * (seq + 5) / 2)

    (rounding and the floor of 1 ignored). It is an upper bound in practice: a document that ends before
    the target gives a shorter sample, and spans may not fill the budget exactly.
    """
    if masked_lm_prob <= 0:
        return 0.0
    return masked_lm_prob * ((1.0 - short_seq_prob) * seq + short_seq_prob * (seq + 5) / 2.0)


@dataclass(frozen=True)
class ModelShape:
    """Everything the formulas need about the model; V is the *padded* vocabulary."""

    arch: str
    num_layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    positions: int
    ffn: int
    num_tokentypes: int = 0
    binary_head: bool = False
    masked: float | None = None
    """BERT: expected masked (predicted) positions per sequence, where the LM head runs; None = all."""
    kv_heads: int | None = None
    """Key/value heads g (grouped-query attention); None = ``heads`` (multi-head attention)."""
    gated: bool = False
    """SwiGLU MLP: gate and up projections h -> f each, down f -> h (three matrices)."""
    untied: bool = False
    """A separate output layer V x h (``untie_embeddings_and_output_weights``)."""
    bias: bool = True
    """Biases in the attention output projection and the MLP linears (``add_bias_linear``)."""
    qkv_bias: bool | None = None
    """Bias in the QKV linear; None = ``bias`` (``add_bias_linear or add_qkv_bias``)."""
    rmsnorm: bool = False
    """RMSNorm (weight only, h) instead of LayerNorm (weight and bias, 2h)."""
    learned_positions: bool = True
    """A learned position table P x h (False: RoPE)."""

    @property
    def kv_hidden(self) -> int:
        """Rows of each of the K and V projections: g x head size (= h without GQA)."""
        return self.hidden if self.kv_heads is None else self.kv_heads * (self.hidden // self.heads)

    @property
    def norm_params(self) -> int:
        return self.hidden if self.rmsnorm else 2 * self.hidden

    @classmethod
    def from_config(cls, m: ModelConfig, tp: int, bert_cfg: BertDataConfig | None = None) -> ModelShape:
        if m.vocab_size is None:
            raise ConfigError("model.vocab_size must be set for planning (e.g. model.vocab_size=50257)")
        bert = m.arch == "bert"
        masked = None
        if bert:
            b = bert_cfg or BertDataConfig()
            masked = bert_expected_masked_positions(b.masked_lm_prob, b.short_seq_prob, m.seq_length)
        return cls(arch=m.arch, num_layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                   seq=m.seq_length, vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp),
                   positions=m.positions, ffn=m.ffn_size,
                   num_tokentypes=m.num_tokentypes if bert else 0, binary_head=bert and m.binary_head,
                   masked=masked, kv_heads=m.num_query_groups, gated=m.activation == "swiglu",
                   untied=m.untie_embeddings_and_output_weights, bias=m.add_bias_linear, qkv_bias=m.qkv_bias,
                   rmsnorm=m.normalization == "rmsnorm", learned_positions=m.position_embedding == "learned")


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------
def layer_params(shape: ModelShape, tp: int = 1) -> int:
    """One transformer layer on one TP rank.

    QKV [3h, h] + bias 3h and h->f [f, h] + bias f are column-parallel (divided by t); the two
    row-parallel weights [h, h] and [h, f] are divided by t but their biases (h each) are replicated;
    the two LayerNorms (2h each) are replicated. t = 1: 4h^2 + 2hf + 3h + f + 2h + 4h (= 12h^2 + 13h).
    Llama blocks: QKV [h + 2k, h] with k = g h / a (GQA), the SwiGLU fc [2f, h] (+ 2f bias), biases only
    with ``bias``/``qkv_bias``, RMSNorms of h each.
    """
    h, f, kv = shape.hidden, shape.ffn, shape.kv_hidden
    fc_rows = (2 if shape.gated else 1) * f
    qkv_bias = shape.bias if shape.qkv_bias is None else shape.qkv_bias
    split = (h + 2 * kv) * h + h * h + fc_rows * h + f * h
    split += (h + 2 * kv) * qkv_bias + fc_rows * shape.bias
    return split // tp + 2 * h * shape.bias + 2 * shape.norm_params


def embedding_params(shape: ModelShape, tp: int = 1) -> int:
    """Word embedding V x h (vocab-parallel) + positions P x h (none with RoPE; + BERT token types T x h),
    per TP rank."""
    h = shape.hidden
    return shape.vocab * h // tp + shape.positions * h * shape.learned_positions + shape.num_tokentypes * h


def head_params(shape: ModelShape, tp: int = 1) -> int:
    """Everything after the last layer except the tied output weight: final LN (2h, RMSNorm h), the untied
    output layer V x h (vocab-parallel); BERT adds the LM head dense (h^2 + h) + LN (2h) + vocab-parallel
    bias (V/t), pooler (h^2 + h) and binary head (2h + 2) when the binary head is on."""
    h = shape.hidden
    n = shape.norm_params
    if shape.untied:
        n += shape.vocab * h // tp
    if shape.arch == "bert":
        n += h * h + h + 2 * h + shape.vocab // tp
        if shape.binary_head:
            n += h * h + h + 2 * h + 2
    return n


def total_params(shape: ModelShape) -> int:
    """Whole model, tied output embedding counted once (this is the number the paper quotes); an untied
    output layer is counted in :func:`head_params`."""
    return embedding_params(shape) + shape.num_layers * layer_params(shape) + head_params(shape)


def stage_params(shape: ModelShape, tp: int, pp: int, dualpipev: bool = False) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage.

    Stage 0 holds the embeddings, the last stage the final LN/heads; with pp > 1 the last stage also
    keeps its own copy of the embedding module for the tied output layer (``training.models.gpt2_pipe``
    ties the whole ``EmbeddingPipe`` between the two ends), so the word embedding is stored twice in the
    pipeline, and so is the position table, which the output layer does not use but which is held with
    its gradient and Adam states all the same (Megatron 2021 keeps only the word embedding there).
    Checked against the engine's tensors in ``tests/parallel/test_plan_measured.py``. With an untied output layer
    nothing is tied: the last stage holds the output layer (in :func:`head_params`) and no embedding. Under
    DualPipeV (``dualpipev``) rank 0 holds the first and the last stage, the tied embedding once (one module).
    """
    last = 0 if dualpipev and pp > 1 else pp - 1
    out = []
    for i, layers in enumerate(stage_layers(shape.num_layers, pp)):
        n = layers * layer_params(shape, tp)
        if i == 0:
            n += embedding_params(shape, tp)
        if i == last:
            n += head_params(shape, tp)
            if pp > 1 and not shape.untied and not dualpipev:
                n += embedding_params(shape, tp)
        out.append(n)
    return out


# --------------------------------------------------------------------------------------------------
# FLOPs: three forward terms, composed by step_flops (planner) and the *_flops_per_iteration (MFU)
# --------------------------------------------------------------------------------------------------
def transformer_layer_forward_flops(tokens: int, seq: int, hidden: int, ffn: int, kv_hidden: int | None = None,
                                    gated: bool = False) -> int:
    """One layer's forward for ``tokens`` = B s tokens: QKV 6 h^2 + projection 2 h^2 + MLP 4 h f
    (= 24 h^2 for f = 4h) per token, plus attention scores Q K^T and probabilities x V: 4 s h per token.

    Grouped-query attention (``kv_hidden`` k = g h / a rows for each of K and V): QKV 2 h (h + 2k); the
    scores and P x V stay 4 s h (every query head attends). SwiGLU (``gated``): MLP 6 h f (gate, up, down)."""
    h = hidden
    kv = h if kv_hidden is None else kv_hidden
    mlp = (6 if gated else 4) * h * ffn
    return tokens * (2 * h * (h + 2 * kv) + 2 * h * h + mlp + 4 * seq * h)


def attention_core_forward_flops(tokens: int, seq: int, hidden: int) -> int:
    """The attention core of one layer's forward for ``tokens`` = B s tokens: scores Q K^T and probabilities
    x V, 2 s h each per token (every query head, also with GQA): the FLOPs that selective recomputation
    runs once more in backward (softmax and dropout are not matmuls)."""
    return tokens * 4 * seq * hidden


def recomputed_flops(shape: ModelShape, global_batch: int, recompute: str) -> float:
    """FLOPs one step spends recomputing in backward, whole model: 'full' one more forward of every layer,
    'selective' one more forward of every attention core (Korthikanti et al. 2022: 4 B s^2 h l, i.e.
    s / (18 h + 3 s) of the layers' forward + backward for f = 4h), 'none' nothing."""
    tokens = global_batch * shape.seq
    if recompute == "full":
        return shape.num_layers * layer_forward_flops(shape, tokens)
    if recompute == "selective":
        return shape.num_layers * attention_core_forward_flops(tokens, shape.seq, shape.hidden)
    return 0.0


def gpt_head_forward_flops(tokens: int, hidden: int, vocab: int) -> int:
    """The tied output layer at every position: 2 h V per token."""
    return 2 * tokens * hidden * vocab


def bert_heads_forward_flops(sequences: int, predicted: float, hidden: int, vocab: int, binary_head: bool) -> float:
    """BERT's heads for ``sequences`` sequences: the MLM head only at the ``predicted`` positions per
    sequence (``x[loss_mask]``: dense 2 h^2 + tied vocabulary projection 2 h V; GeLU, LayerNorm, bias and
    cross-entropy are not matmuls), plus with the sentence-order head the pooler dense at [CLS] 2 h^2 and
    SOP Linear(h, 2) 4 h per sequence."""
    h = hidden
    head = 2 * sequences * predicted * h * (h + vocab)
    if binary_head:
        head += sequences * (2 * h * h + 4 * h)
    return head


def training_flops(layers_forward: float, head_forward: float, ckpt: bool) -> float:
    """Forward + backward of one step from the forward FLOPs of the transformer layers and of the head:
    3 x forward, and with full activation checkpointing one more forward of the layers (the head is not
    recomputed)."""
    return (4 if ckpt else 3) * layers_forward + 3 * head_forward


def layer_forward_flops(shape: ModelShape, tokens: int) -> float:
    """2 x multiply-adds of one layer's forward for ``tokens`` = B s tokens:
    QKV 6 h^2 + projection 2 h^2 + MLP 4 h f (= 24 h^2 for f = 4h) per token, plus attention
    scores and scores x V: 4 s h per token."""
    return transformer_layer_forward_flops(tokens, shape.seq, shape.hidden, shape.ffn, shape.kv_hidden, shape.gated)


def step_flops(shape: ModelShape, global_batch: int, ckpt: bool) -> float:
    """FLOPs of one optimizer step over the whole model and batch.

    Forward + backward = 3 x forward. With full activation checkpointing every layer's forward runs
    twice (4 x), the logit layer (2 B s h V forward) is not recomputed. For GPT-2 with checkpointing this
    is exactly Narayanan et al. 2021 eq. (3):  96 B s l h^2 (1 + s/(6h) + V/(16 l h));  without it the
    transformer part is 3/4 of that. BERT's LM head (dense 2 h^2 + vocabulary 2 h V per position) runs
    only at its ``shape.masked`` positions per sequence (all ``s`` when None), plus the pooler and
    sentence-order head (2 h^2 + 4 h per sequence), as :func:`bert_flops_per_iteration`.
    """
    tokens = global_batch * shape.seq
    layers = shape.num_layers * layer_forward_flops(shape, tokens)
    head: float
    if shape.arch == "bert":
        predicted = shape.masked if shape.masked is not None else shape.seq
        head = bert_heads_forward_flops(global_batch, predicted, shape.hidden, shape.vocab, shape.binary_head)
    else:
        head = gpt_head_forward_flops(tokens, shape.hidden, shape.vocab)
    return training_flops(layers, head, ckpt)


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                              ffn: int | None = None, kv_hidden: int | None = None, gated: bool = False) -> float:
    """Forward + backward model FLOPs of one GPT iteration over ``batch`` sequences (no recomputation):
    72 B s l h^2 (1 + s/(6h)) + 6 B s h V for f = 4h; ``kv_hidden``/``gated`` for GQA and SwiGLU
    (:func:`transformer_layer_forward_flops`; an untied output layer costs what the tied one does)."""
    ffn = ffn or 4 * hidden
    tokens = batch * seq
    return float(training_flops(layers * transformer_layer_forward_flops(tokens, seq, hidden, ffn, kv_hidden, gated),
                                gpt_head_forward_flops(tokens, hidden, vocab), ckpt=False))


def bert_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int, masked: float,
                             ffn: int | None = None, binary_head: bool = True) -> float:
    """Forward + backward model FLOPs of one BERT pretraining iteration (``training.models.bert``).

    Per sequence of ``s = seq`` positions (padding included: the encoder runs on all of them), forward:

    * each of the ``l`` layers: QKV 2 s h 3h + output projection 2 s h h + MLP 2 * 2 s h f
      + attention scores Q K^T 2 s^2 h + probabilities x V 2 s^2 h
      = 2 s h (4h + 2f) + 4 s^2 h  (with f = 4h: 24 s h^2 + 4 s^2 h, as in Narayanan et al.);
    * the MLM head only at the ``m = masked`` positions (``x[loss_mask]``): dense 2 m h^2 and the tied
      vocabulary projection 2 m h V (GeLU, LayerNorm, bias and cross-entropy are not matmuls);
    * with the sentence-order head (``binary_head``): pooler dense at [CLS] 2 h^2, SOP Linear(h, 2) 4 h.

    Total: 3 B [ l (2 s h (4h + 2f) + 4 s^2 h) + 2 m h (h + V) + (2 h^2 + 4 h) ]. Against the GPT
    formula this replaces the 2 s h V logits (every position) by 2 m h (h + V); with m ~ 0.15 s the
    GPT count overstates BERT's FLOPs by the difference (~8 % for the 336M model).
    ``masked``: masked positions per sequence, :func:`bert_expected_masked_positions` for pretraining.
    Not counted (not matmuls): softmax, LayerNorm, GeLU, dropout, embedding lookups.
    """
    ffn = ffn or 4 * hidden
    return float(training_flops(layers * transformer_layer_forward_flops(batch * seq, seq, hidden, ffn),
                                bert_heads_forward_flops(batch, masked, hidden, vocab, binary_head), ckpt=False))


def flops_per_iteration(cfg: Config, padded_vocab: int) -> float:
    """Model FLOPs of one iteration of ``cfg`` (a ``training.config.Config``) for its ``model.arch``."""
    m, t = cfg.model, cfg.train
    if m.arch == "bert":
        masked = bert_expected_masked_positions(cfg.bert.masked_lm_prob, cfg.bert.short_seq_prob, m.seq_length)
        return bert_flops_per_iteration(t.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, padded_vocab,
                                        masked, m.ffn_size, m.binary_head)
    kv = m.query_groups * (m.hidden_size // m.num_attention_heads)
    return model_flops_per_iteration(t.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, padded_vocab,
                                     m.ffn_size, kv, m.activation == "swiglu")
