"""The model's shape: :class:`ModelConfig` (the ``model:`` section of a run config), its RoPE scaling and the
width rules (MLP width, padded vocabulary, the Llama-family options and what BERT refuses).

It sits beside the models (as torchtitan's ``models/llama3/model/args.py``): ``training.models`` reads its shape
from here and imports no run-config module (``tests/unit/test_architecture.py``); the run config
(:mod:`training.config`) holds a :class:`ModelConfig` as its ``model`` section.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from megatron_ds_suite.core.config import AtLeastOne, Freezable, NonNegative, Positive, Range
from megatron_ds_suite.core.errors import ConfigError


@dataclass
class RopeScalingConfig(Freezable):
    """Llama 3's RoPE frequency scaling (Llama 3.1+; ``transformers``' ``rope_scaling`` / ``rope_parameters`` with
    ``rope_type: llama3``, the same names): frequencies that turn fewer than ``low_freq_factor`` times over the
    original context are divided by ``factor``, those turning more than ``high_freq_factor`` times kept, those in
    between blended (``training/models/rotary.py``). Llama 3.1's values are the defaults."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    """The context length the model was pretrained at before the scaling (L)."""


@dataclass
class ModelConfig(Freezable):
    arch: Literal["gpt", "gpt2", "bert"] = "gpt"
    """Model family: 'gpt' (``GPTModel``: GPT-2, and the Llama family by the options below) or 'bert'. 'gpt2' is
    the old name of 'gpt', still accepted and kept as written (saved configs and checkpoints hold either);
    code tells the two families apart by ``arch == "bert"``."""
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 128
    """Training sequence length (tokens per sample)."""
    max_position_embeddings: int | None = None
    """Learned position table size; defaults to seq_length."""
    vocab_size: Annotated[int, AtLeastOne] | None = None
    """Unpadded vocabulary size; None = take it from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary is padded to a multiple of this x TP (Megatron's rule)."""
    ffn_hidden_size: Annotated[int, NonNegative] | None = None
    """MLP width; defaults to 4 x hidden_size."""
    hidden_dropout: Annotated[float, Range(ge=0, lt=1)] = 0.1
    attention_dropout: Annotated[float, Range(ge=0, lt=1)] = 0.1
    apply_query_key_layer_scaling: bool = False
    """Megatron's fp16 stabiliser: layer l's Q.K scores are computed divided by l and multiplied back inside
    an fp32 softmax (forces attention_softmax_in_fp32). Same math in fp32; see models/core_attention.py."""
    attention_softmax_in_fp32: bool = False
    """Megatron: compute the attention softmax in fp32 when activations are fp16/bf16."""
    init_method_std: Annotated[float, Positive] = 0.02
    layernorm_epsilon: Annotated[float, Positive] = 1e-5
    activation: Literal["gelu", "gelu_new", "swiglu"] = "gelu"
    """MLP (and BERT LM-head) non-linearity: 'gelu' = exact erf GeLU (Megatron's default), 'gelu_new' =
    the tanh approximation OpenAI's GPT-2 was trained with (transformers' name; imported GPT-2s use it),
    'swiglu' = Llama's gated MLP ``down(silu(gate(x)) * up(x))`` (GPT only): gate and up are one
    column-parallel weight [gate; up] (stride 2, so each rank holds its own gate and up columns), three
    matrices of h x f; unset ``ffn_hidden_size`` follows Llama's rule (:attr:`ffn_size`)."""
    # Llama-family shapes (Megatron-Core's names); the defaults are GPT-2/BERT as before
    position_embedding: Literal["learned", "rope"] = "learned"
    """'learned' = a trained position table added to the word embeddings (GPT-2, BERT); 'rope' = rotary
    position embeddings applied to each head's queries and keys (Su et al. 2021; Llama, GPT-NeoX), no
    table. GPT only."""
    rotary_base: Annotated[float, Positive] = 10000.0
    """RoPE base theta: frequencies base^(-2i/d) (Llama 2: 10,000; Llama 3: 500,000)."""
    rotary_percent: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Fraction of each head's dimensions that RoPE rotates (the first ones; the rest pass unchanged):
    1.0 for Llama, 0.25 for GPT-NeoX/Pythia. head size x rotary_percent must be a positive even number."""
    rope_scaling: RopeScalingConfig | None = None
    """RoPE frequency scaling: None = plain RoPE; ``{rope_type: llama3, factor: 8, low_freq_factor: 1,
    high_freq_factor: 4, original_max_position_embeddings: 8192}`` = Llama 3.1's (:class:`RopeScalingConfig`)."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """'layernorm' (weight and bias, GPT-2/BERT) or 'rmsnorm' (x / sqrt(mean(x^2) + eps) * weight, no bias
    or centring; computed in fp32; Llama). Same ``layernorm_epsilon``. GPT only."""
    num_query_groups: int | None = None
    """Grouped-query attention: the number of key/value heads, each shared by num_attention_heads /
    num_query_groups query heads (1 = multi-query attention). None (or equal to the head count) =
    multi-head attention. At TP=t each rank holds num_query_groups / t whole groups: t must divide it.
    GPT only."""
    untie_embeddings_and_output_weights: bool = False
    """False: the output layer is the word embedding (GPT-2). True: a separate vocab-parallel output
    weight [V, h] ``output_layer.weight`` (Llama). GPT only."""
    sliding_window: Annotated[int, AtLeastOne] | None = None
    """Mistral's sliding-window attention: each token attends to itself and the ``sliding_window - 1`` tokens before
    it (transformers' ``sliding_window``: key j is seen from query i when i - j < sliding_window); None = the whole
    causal prefix. In training, evaluation and KV-cached generation (the cache keeps every position: no rolling
    buffer). GPT only; not under pipeline or context parallelism."""
    mask_vocab_padding: bool = False
    """True: the padding columns of the vocabulary (Megatron pads it to a multiple of
    make_vocab_size_divisible_by x TP) are left out of the training softmax, so the loss does not depend on the TP
    degree's padding (a reshard to another TP then keeps the loss). False (Megatron's): they stay in. GPT only."""
    add_bias_linear: bool = True
    """Biases in the attention (QKV, output projection) and MLP linears; false = none (Llama). The
    LayerNorm bias is not a linear's: ``normalization: rmsnorm`` has none."""
    add_qkv_bias: bool = False
    """A bias in the QKV linear even when add_bias_linear is false (Megatron-Core's key; Qwen2's shape)."""
    recompute: Literal["none", "selective", "full", "auto"] = "none"
    """Activation recomputation in backward (Korthikanti et al. 2022). ``none``: every layer keeps its
    activations. ``selective``: only the attention core (scores, softmax, dropout, probabilities x V) is
    recomputed, where the core keeps its s x s matrices for backward: Megatron's fp16 core
    (``apply_query_key_layer_scaling`` / ``attention_softmax_in_fp32``) and the CPU attention-dropout path; SDPA's
    fused kernels (flash, memory-efficient: on GPUs, and on CPU without attention dropout) keep no s x s
    matrix and recompute the scores in their backward kernel already, so there selective is ``none``
    (``training/models/core_attention.py``). ``full``: every transformer layer is recomputed (DeepSpeed's checkpoint,
    RNG states restored). ``auto``: the planner decides when the trainer starts, from the smallest device
    memory over the ranks: none where weights, gradients, optimizer states and activations fit 90 % of it,
    else selective where that fits, else full (``training/plan/recompute.py``; the choice is logged and saved
    in RUN_DIR/config.json)."""
    activation_checkpointing: bool | Literal["auto"] | None = None
    """Deprecated spelling of ``recompute``, still accepted: true = ``full``, false = ``none``, auto = ``auto``
    (set only one of the two; read into ``recompute`` when the config is built, then None)."""
    compile: bool = False
    """``torch.compile`` every transformer layer (torchtitan-style, one compiled graph shared by all layers;
    element-wise work fused): one graph per layer at any TP degree, with or without dropout (attention dropout's
    model-parallel stream becomes a traced counter-based mask, ``training/parallel/random.py``). Numerics equal
    eager in fp32 without dropout (dropout masks are drawn by the compiled code: other numbers, same distribution)."""
    cuda_graph: bool = False
    """Replay every compiled layer as CUDA graphs (implies ``compile``; torch's CUDA-graph trees, ``torch.compile``
    mode ``reduce-overhead``: one capture per layer call site, Megatron's per-layer graphs). CUDA only; not yet run
    on a GPU (``scripts/gpu_check.sh --only cuda_graph``). What blocks a whole-step capture: docs/gpu_step.md."""
    # BERT only
    layer_order: Literal["pre_ln", "post_ln"] = "pre_ln"
    """BERT: 'pre_ln' = the paper's rearranged order (Figure 7), 'post_ln' = original BERT."""
    num_tokentypes: Annotated[int, NonNegative] = 2
    binary_head: bool = True
    head: Literal["pretrain", "multiple_choice"] = "pretrain"
    """BERT: which heads the checkpoint holds; 'multiple_choice' is written by training.finetune_race."""
    lm_head_activation: Literal["gelu", "gelu_new"] | None = None
    """BERT: the MLM head's GeLU when it is not ``activation``'s (None = the same). Megatron-LM's BERT runs its
    MLP through the fused bias-GeLU kernel (tanh form, ``--bias-gelu-fusion``, its default) but its LM head
    through the exact erf GeLU: its imports (``training.tools.import_megatron``) set 'gelu' here."""

    def __post_init__(self) -> None:  # ModelConfig(activation_checkpointing=...) from Python (files: read_old_keys)
        old = self.activation_checkpointing
        if old is None:
            return
        mapped = OLD_RECOMPUTE_KEY[old]
        if self.recompute not in ("none", mapped):
            raise ConfigError(f"model.activation_checkpointing={str(old).lower()} (the old key) disagrees with "
                              f"model.recompute={self.recompute}: set only model.recompute (none | selective | "
                              f"full | auto)")
        self.recompute, self.activation_checkpointing = mapped, None

    @property
    def positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def ffn_size(self) -> int:
        """MLP width f: ``ffn_hidden_size``; unset, 4 h, or with swiglu Llama's rule
        :func:`swiglu_ffn_size` (2/3 of 4 h, rounded up to a multiple of 256: 11,008 at h = 4096)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return swiglu_ffn_size(self.hidden_size) if self.activation == "swiglu" else 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or the head count (multi-head attention)."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates: head size x rotary_percent (0 without RoPE)."""
        if self.position_embedding != "rope":
            return 0
        return int(self.hidden_size // self.num_attention_heads * self.rotary_percent)

    @property
    def llama3_rope_scaling(self) -> tuple[float, float, float, int] | None:
        """``rope_scaling`` as (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
        r = self.rope_scaling
        if r is None:
            return None
        return r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings

    def shape(self) -> WidthShape:
        """The widths :func:`validate_shape` checks (the vocabulary left out: its padding is a multiple of TP)."""
        return WidthShape(arch=self.arch, num_layers=self.num_layers, hidden=self.hidden_size,
                          heads=self.num_attention_heads, kv_heads=self.num_query_groups, ffn=self.ffn_size,
                          seq=self.seq_length, positions=self.positions)

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def llama_options(self) -> list[str]:
        """The GPT-only options this config sets away from their GPT-2/BERT defaults, as ``key=value``."""
        out = []
        for key, default in GPT_ONLY_DEFAULTS.items():
            value = getattr(self, key)
            if value != default:
                out.append(f"model.{key}={value}")
        return out


SWIGLU_MULTIPLE_OF = 256
"""Llama's ``multiple_of``: the SwiGLU MLP width is rounded up to a multiple of it."""

GPT_ONLY_DEFAULTS: dict[str, Any] = {"position_embedding": "learned", "rope_scaling": None, "normalization": "layernorm",
                                     "num_query_groups": None, "untie_embeddings_and_output_weights": False,
                                     "add_bias_linear": True, "add_qkv_bias": False,
                                     "mask_vocab_padding": False, "sliding_window": None}
"""ModelConfig keys (and their defaults) that only the GPT model computes; BERT refuses other values
(and ``activation: swiglu``)."""


def swiglu_ffn_size(hidden: int, multiple_of: int = SWIGLU_MULTIPLE_OF) -> int:
    """Llama's SwiGLU width for ``ffn_hidden_size`` unset (Meta's reference ``FeedForward``): the 4 h of a
    GeLU MLP times 2/3, so that three h x f matrices hold as many weights as two h x 4h ones, rounded
    up to a multiple of ``multiple_of``: ``multiple_of * ceil(int(2 * 4h / 3) / multiple_of)``
    (h = 4096 -> 11,008, Llama 2 7B's; h = 96 -> 256)."""
    f = int(2 * 4 * hidden / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


OLD_RECOMPUTE_KEY = {True: "full", False: "none", "auto": "auto"}
"""``model.activation_checkpointing`` (the key before ``model.recompute``) -> the ``model.recompute`` it means."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Smallest multiple of ``divisible_by * tp`` that is >= vocab_size (Megatron's padding)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def validate_model_options(m: ModelConfig) -> None:
    """The Llama-family options (RoPE, RMSNorm, SwiGLU, GQA, untied output, no biases): ranges and their
    combinations, each refused in one line (their fit to the parallel layout is :func:`validate_shape`'s)."""
    if m.arch == "bert":
        bad = m.llama_options() + (["model.activation=swiglu"] if m.activation == "swiglu" else [])
        if bad:
            raise ConfigError(f"{', '.join(bad)}: the Llama-family options are for GPT (model.arch: gpt); "
                              f"BERT keeps learned positions, LayerNorm, GeLU, multi-head attention, tied "
                              f"embeddings and biases")
    if m.lm_head_activation is not None and m.arch != "bert":
        raise ConfigError(f"model.lm_head_activation={m.lm_head_activation} is for BERT's MLM head; GPT has none")
    heads = m.num_attention_heads
    if m.position_embedding == "rope":
        head = m.hidden_size // heads
        rot = m.rotary_dim
        if rot < 2 or rot % 2:
            raise ConfigError(f"model.rotary_percent={m.rotary_percent} rotates {rot} of the {head} dimensions of "
                              f"a head: RoPE needs a positive even number (head size x rotary_percent)")
    elif m.rotary_percent != 1.0 or m.rotary_base != 10000.0 or m.rope_scaling is not None:
        raise ConfigError("model.rotary_base / model.rotary_percent / model.rope_scaling are set but "
                          "model.position_embedding is 'learned': set model.position_embedding=rope")
    r = m.rope_scaling
    if r is not None and not (r.factor >= 1.0 and 0.0 < r.low_freq_factor < r.high_freq_factor
                              and r.original_max_position_embeddings >= 1):
        raise ConfigError(f"model.rope_scaling: need factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                          f"original_max_position_embeddings >= 1 (got factor={r.factor}, low_freq_factor="
                          f"{r.low_freq_factor}, high_freq_factor={r.high_freq_factor}, "
                          f"original_max_position_embeddings={r.original_max_position_embeddings})")


# --------------------------------------------------------------------------------------------------
# The one shape validator: a model's widths against a TP x PP layout (the trainer's validate_static and the
# planner's training.plan.layout.validate both call it)
# --------------------------------------------------------------------------------------------------
class Shape(Protocol):
    """What :func:`validate_shape` reads: :class:`WidthShape`, or the planner's ``ModelShape``."""

    arch: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int | None
    ffn: int
    seq: int
    positions: int
    vocab: int | None


@dataclass(frozen=True)
class WidthShape:
    """A :class:`ModelConfig`'s widths, in the planner's names (:meth:`ModelConfig.shape`)."""

    arch: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int | None
    ffn: int
    seq: int
    positions: int
    vocab: int | None = None  # padded vocabulary; None = not checked


#: how the messages name a value: the run config's keys, or the planner's flags (``flags=True``)
CONFIG_NAMES = {"tp": "parallel.tensor={}", "pp": "parallel.pipeline={}", "tp_key": "parallel.tensor",
                "sp": "parallel.sequence_parallel=true", "vocab": "the padded vocabulary {}"}
FLAG_NAMES = {"tp": "--tp {}", "pp": "--pp {}", "tp_key": "--tp", "sp": "sequence parallelism",
              "vocab": "the padded vocabulary {}"}


def validate_shape(shape: Shape, tp: int, pp: int, sequence_parallel: bool = False, flags: bool = False) -> None:  # noqa: C901
    """One-line ConfigError when a model's widths do not fit TP x PP: heads divide the hidden size, TP divides
    the heads, the key/value groups, the MLP width and the padded vocabulary; every pipeline stage holds at least
    one layer (an uneven split is legal: DeepSpeed's balanced partition, :func:`stage_layers`, which trainer and
    planner both use); sequence parallelism needs TP > 1 and a
    sequence that splits over it; the positions cover the sequence. ``flags``: name TP/PP as the planner's
    ``--tp``/``--pp``."""
    n = FLAG_NAMES if flags else CONFIG_NAMES
    tp_s, pp_s = n["tp"].format(tp), n["pp"].format(pp)
    heads, groups = f"model.num_attention_heads={shape.heads}", f"model.num_query_groups={shape.kv_heads}"
    if shape.hidden % shape.heads:
        raise ConfigError(f"model.hidden_size={shape.hidden} is not divisible by {heads}")
    if shape.heads % tp:
        raise ConfigError(f"{tp_s} does not divide {heads}: choose a TP degree that divides the head count")
    if shape.kv_heads is not None:
        if shape.kv_heads < 1:
            raise ConfigError(f"model.num_query_groups must be >= 1 (or null for multi-head attention), got "
                              f"{shape.kv_heads}")
        if shape.heads % shape.kv_heads:
            raise ConfigError(f"{groups} does not divide {heads}: each key/value head serves the same number of "
                              f"query heads")
        if shape.kv_heads % tp:
            raise ConfigError(f"{tp_s} does not divide {groups}: each TP rank holds whole key/value groups; choose "
                              f"a TP degree that divides {shape.kv_heads}")
    if shape.ffn % tp:
        raise ConfigError(f"{tp_s} does not divide the MLP width {shape.ffn}")
    if shape.vocab is not None and shape.vocab % tp:
        raise ConfigError(f"{tp_s} does not divide {n['vocab'].format(shape.vocab)}")
    if pp > shape.num_layers:
        raise ConfigError(f"{pp_s} exceeds model.num_layers={shape.num_layers}: every pipeline stage needs at least "
                          f"one layer; choose a pipeline degree of at most {shape.num_layers}")
    if sequence_parallel and tp == 1:
        raise ConfigError(f"{n['sp']} needs {n['tp_key']} > 1 (it splits the sequence across the tensor-parallel "
                          f"ranks)")
    if sequence_parallel and shape.seq % tp:
        raise ConfigError(f"{n['sp']}: model.seq_length={shape.seq} is not a multiple of {tp_s}")
    if shape.positions < shape.seq:
        raise ConfigError(f"model.max_position_embeddings={shape.positions} < model.seq_length={shape.seq}")


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Transformer layers of each pipeline stage, first to last: DeepSpeed's balanced partition of the pipeline
    model (``PipelineModule(partition_method="type:TransformerLayer")``, ``training.models.gpt2_pipe``; BERT's
    ``type:BertLayerPipe``, ``training.models.bert_pipe``), which
    gives the first ``num_layers % pp`` stages one layer more (3 layers over 2 stages: [2, 1]; 10 over 4:
    [3, 3, 2, 2]). Megatron-LM splits only evenly unless told the first/last stage's counts; the planner
    (``training.plan``) counts each stage with these numbers, the slowest being the first."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]
