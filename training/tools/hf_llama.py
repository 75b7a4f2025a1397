"""Llama <-> ``transformers``: the name and layout map between ``LlamaForCausalLM`` and our GPT model with the
Llama options (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output, no biases), for import and export.

Checked in ``tests/parallel/test_llama_blocks.py``: a random ``LlamaForCausalLM`` mapped with :func:`from_hf` gives
the same logits as ``transformers`` (fp32) and :func:`to_hf` gives its state dict back exactly.

    model.embed_tokens.weight [V, h]                  -> embedding.word_embeddings.weight [V_padded, h]
    model.layers.i.input_layernorm.weight             -> layers.i.ln1.weight (RMSNorm)
    model.layers.i.self_attn.{q,k,v}_proj.weight      -> layers.i.attn.qkv.weight: [Q; K; V] (n = g) or, per
                                                         key/value group, [its q heads; k; v] (GQA; fuse_qkv)
    model.layers.i.self_attn.o_proj.weight            -> layers.i.attn.proj.weight
    model.layers.i.post_attention_layernorm.weight    -> layers.i.ln2.weight
    model.layers.i.mlp.{gate,up}_proj.weight          -> layers.i.mlp.fc.weight [gate; up] (2f rows)
    model.layers.i.mlp.down_proj.weight               -> layers.i.mlp.proj.weight
    model.norm.weight                                 -> final_ln.weight
    lm_head.weight                                    -> output_layer.weight (or tied to the embedding)

Biases (``attention_bias``, ``mlp_bias``) map to the same modules' ``.bias``. RoPE: plain (``rope_type:
default``) and Llama 3.1+'s ``llama3`` frequency scaling (``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_max_position_embeddings`` <-> ``model.rope_scaling``, the same names); other rope types are refused
in one line, as is a ``head_dim`` other than hidden / heads.
"""
from __future__ import annotations

import torch

from megatron_ds_suite.core.errors import SuiteError
from training.models.config import ModelConfig, RopeScalingConfig
from training.models.qkv import fuse_qkv, split_qkv
from training.tools.hf_interop import check_config


class LlamaMappingError(SuiteError):
    """A Llama config or state dict that does not map (one line)."""


#: ``model_type`` -> the ``transformers`` class of the folders that share Llama's layout and names. Mistral is
#: Llama's block with a sliding window (``model.sliding_window``); Qwen2 adds a bias to q/k/v only
#: (Megatron-Core's ``add_qkv_bias``) and is exported back as ``Qwen2ForCausalLM``.
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The ``llama3`` rope-scaling keys: ``transformers``' names, and ours (``RopeScalingConfig``)."""


def _rope(hf_cfg) -> tuple[str, float, float, dict]:
    """(rope type, theta, partial rotary factor, the scaling's keys) from transformers 5's ``rope_parameters`` or
    4's ``rope_theta`` / ``rope_scaling``."""
    params = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(hf_cfg, "partial_rotary_factor", 1.0))
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            raise LlamaMappingError(f"config.json: {key}={value!r:.60} is not a finite number > 0: fix config.json")
    return kind, float(theta), float(partial), {**scaling, **params}


def _rope_scaling(kind: str, params: dict) -> RopeScalingConfig | None:
    """``model.rope_scaling`` for an HF rope type ('default': none; 'llama3': its four keys)."""
    if kind != "llama3":
        return None
    return RopeScalingConfig(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                             high_freq_factor=float(params["high_freq_factor"]),
                             original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def _hf_rope_parameters(cfg: ModelConfig) -> dict:
    """``rope_parameters`` of ``transformers``' config for ours (theta, and the llama3 scaling when set)."""
    out: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling is not None:
        out["rope_type"] = "llama3"
        out.update({k: getattr(cfg.rope_scaling, k) for k in LLAMA3_KEYS})
    return out


def model_config_from_hf(hf_cfg, seq_length: int | None = None) -> ModelConfig:
    """Our ModelConfig for a ``LlamaConfig``; refuses what our model does not compute."""
    family = getattr(hf_cfg, "model_type", None)
    if family not in LLAMA_FAMILY:
        raise LlamaMappingError(f"model_type {family!r} is not a Llama-family config ({', '.join(LLAMA_FAMILY)})")
    check_config(hf_cfg, counts=("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                 "max_position_embeddings", "vocab_size"), optional_counts=("num_key_value_heads", "head_dim"),
                 probabilities=("attention_dropout",), positives=("rms_norm_eps", "initializer_range"))
    h, n = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    kind, theta, partial, rope_params = _rope(hf_cfg)
    unsupported = []
    window = getattr(hf_cfg, "sliding_window", None) if family == "mistral" else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        unsupported.append(f"sliding_window={window!r:.40} (not a positive integer)")
        window = None
    if family == "qwen2" and getattr(hf_cfg, "use_sliding_window", False):
        unsupported.append("use_sliding_window=true")
    if hf_cfg.hidden_act != "silu":
        unsupported.append(f"hidden_act={hf_cfg.hidden_act!r}")
    if kind not in ("default", "llama3"):
        unsupported.append(f"rope_type={kind!r}")
    head_dim = getattr(hf_cfg, "head_dim", None) or h // n
    if head_dim * n != h:
        unsupported.append(f"head_dim={head_dim} (not hidden_size / num_attention_heads)")
    if getattr(hf_cfg, "attention_bias", False) != getattr(hf_cfg, "mlp_bias", False):
        unsupported.append("attention_bias != mlp_bias")
    if unsupported:
        raise LlamaMappingError(f"the {family} config sets {', '.join(unsupported)}, which this project's model does "
                                f"not compute")
    positions = hf_cfg.max_position_embeddings
    seq = seq_length or min(positions, 4096)
    if seq > positions:
        raise LlamaMappingError(f"--seq-length {seq} exceeds the model's max_position_embeddings {positions}")
    groups = getattr(hf_cfg, "num_key_value_heads", None) or n
    bias = bool(getattr(hf_cfg, "attention_bias", False))
    return ModelConfig(arch="gpt", num_layers=hf_cfg.num_hidden_layers, hidden_size=h, num_attention_heads=n,
                       seq_length=seq, max_position_embeddings=positions, vocab_size=hf_cfg.vocab_size,
                       ffn_hidden_size=hf_cfg.intermediate_size, hidden_dropout=0.0,
                       attention_dropout=float(getattr(hf_cfg, "attention_dropout", 0.0) or 0.0),
                       init_method_std=float(hf_cfg.initializer_range), layernorm_epsilon=float(hf_cfg.rms_norm_eps),
                       activation="swiglu", position_embedding="rope", rotary_base=theta, rotary_percent=partial,
                       rope_scaling=_rope_scaling(kind, rope_params),
                       normalization="rmsnorm", num_query_groups=None if groups == n else groups,
                       untie_embeddings_and_output_weights=not getattr(hf_cfg, "tie_word_embeddings", False),
                       add_bias_linear=bias, add_qkv_bias=family == "qwen2",
                       sliding_window=window if window is not None and window < positions else None)


def hf_config(cfg: ModelConfig, vocab_size: int | None = None):
    """The ``transformers`` config of our model (which must have the Llama options): ``MistralConfig`` with a
    sliding window, ``Qwen2Config`` for a bias on q/k/v only, else ``LlamaConfig``."""
    import transformers

    check_llama_shape(cfg)
    common = dict(vocab_size=vocab_size or cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
                  hidden_act="silu", max_position_embeddings=cfg.positions,
                  initializer_range=cfg.init_method_std, rms_norm_eps=cfg.layernorm_epsilon,
                  tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                  rope_parameters=_hf_rope_parameters(cfg),
                  attention_dropout=cfg.attention_dropout)
    if cfg.sliding_window is not None:
        if cfg.qkv_bias:
            raise LlamaMappingError(f"model.sliding_window={cfg.sliding_window} with biases: transformers' "
                                    f"MistralForCausalLM (the sliding-window Llama block) has none")
        return transformers.MistralConfig(**common, sliding_window=cfg.sliding_window)
    if qkv_bias_only(cfg):
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.LlamaConfig(**common, attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)


def qkv_bias_only(cfg: ModelConfig) -> bool:
    """A bias on the q/k/v projections and nowhere else (Qwen2's block)."""
    return cfg.add_qkv_bias and not cfg.add_bias_linear


def check_llama_shape(cfg: ModelConfig) -> None:
    """Our config must be a Llama block: RoPE (whole head), RMSNorm, SwiGLU, biases all or none."""
    bad = []
    if cfg.arch == "bert":
        bad.append(f"arch={cfg.arch}")
    if cfg.position_embedding != "rope" or cfg.rotary_percent != 1.0:
        bad.append("position_embedding must be rope with rotary_percent 1.0")
    if cfg.normalization != "rmsnorm":
        bad.append("normalization must be rmsnorm")
    if cfg.activation != "swiglu":
        bad.append("activation must be swiglu")
    if bad:
        raise LlamaMappingError(f"not a Llama-shaped model ({'; '.join(bad)})")


def _layer_pairs(i: int, bias: bool) -> list[tuple[str, str]]:
    """(our name, HF name) of layer i's tensors that map one to one."""
    a, h = f"layers.{i}.", f"model.layers.{i}."
    out = [(a + "ln1.weight", h + "input_layernorm.weight"), (a + "ln2.weight", h + "post_attention_layernorm.weight"),
           (a + "attn.proj.weight", h + "self_attn.o_proj.weight"), (a + "mlp.proj.weight", h + "mlp.down_proj.weight")]
    if bias:
        out += [(a + "attn.proj.bias", h + "self_attn.o_proj.bias"), (a + "mlp.proj.bias", h + "mlp.down_proj.bias")]
    return out


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> our TP=1 names (fp32, vocabulary not padded yet)."""
    check_llama_shape(cfg)

    def get(name: str) -> torch.Tensor:
        for key in (name, name[len("model."):]):  # LlamaModel folders lack the prefix
            if key in hf:
                return hf[key].detach().to(torch.float32).cpu().contiguous()
        raise LlamaMappingError(f"the source weights lack {name!r}: not a Llama checkpoint of this shape")

    n, g, bias = cfg.num_attention_heads, cfg.query_groups, cfg.add_bias_linear
    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"), "final_ln.weight": get("model.norm.weight")}
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = get("lm_head.weight")
    elif "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"].detach().float().cpu(),
                                                     out["embedding.word_embeddings.weight"]):
        raise LlamaMappingError("lm_head.weight differs from model.embed_tokens.weight but the config ties them")
    for i in range(cfg.num_layers):
        a, h = f"layers.{i}.", f"model.layers.{i}.self_attn."
        for ours, theirs in _layer_pairs(i, bias):
            out[ours] = get(theirs)
        for kind in ["weight", "bias"] if bias or cfg.add_qkv_bias else ["weight"]:
            out[a + f"attn.qkv.{kind}"] = fuse_qkv(get(h + f"q_proj.{kind}"), get(h + f"k_proj.{kind}"),
                                                   get(h + f"v_proj.{kind}"), n, g)
        for kind in ["weight", "bias"] if bias else ["weight"]:
            m = f"model.layers.{i}.mlp."
            out[a + f"mlp.fc.{kind}"] = torch.cat([get(m + f"gate_proj.{kind}"), get(m + f"up_proj.{kind}")])
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our TP=1 state dict (any vocabulary padding) -> ``LlamaForCausalLM`` names, the vocabulary cut to
    ``vocab_size`` rows (inverse of :func:`from_hf`)."""
    check_llama_shape(cfg)
    n, g, bias = cfg.num_attention_heads, cfg.query_groups, cfg.add_bias_linear
    emb = state["embedding.word_embeddings.weight"][:vocab_size].contiguous()
    out = {"model.embed_tokens.weight": emb, "model.norm.weight": state["final_ln.weight"]}
    out["lm_head.weight"] = (state["output_layer.weight"][:vocab_size].contiguous()
                             if cfg.untie_embeddings_and_output_weights else emb)
    for i in range(cfg.num_layers):
        a, h = f"layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _layer_pairs(i, bias):
            out[theirs] = state[ours]
        for kind in (["weight", "bias"] if bias or cfg.add_qkv_bias else ["weight"]):
            q, k, v = split_qkv(state[a + f"attn.qkv.{kind}"], n, g)
            out[h + f"self_attn.q_proj.{kind}"] = q.contiguous()
            out[h + f"self_attn.k_proj.{kind}"] = k.contiguous()
            out[h + f"self_attn.v_proj.{kind}"] = v.contiguous()
        for kind in (["weight", "bias"] if bias else ["weight"]):
            gate, up = state[a + f"mlp.fc.{kind}"].chunk(2, dim=0)
            out[h + f"mlp.gate_proj.{kind}"] = gate.contiguous()
            out[h + f"mlp.up_proj.{kind}"] = up.contiguous()
    return out


def build_hf_llama(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int, eod: int | None = None):
    """A ``LlamaForCausalLM`` holding our merged (TP=1) weights, the vocabulary cut to ``vocab_size`` (strict
    load: every tensor of the transformers model is provided)."""
    import transformers

    hc = hf_config(cfg, vocab_size)
    hc.bos_token_id = hc.eos_token_id = eod
    name = LLAMA_FAMILY["mistral" if cfg.sliding_window is not None else "qwen2" if qkv_bias_only(cfg) else "llama"]
    hc.architectures = [name]
    model = getattr(transformers, name)(hc)
    weights = to_hf({k: v.detach().to(torch.float32).cpu() for k, v in state.items()}, cfg, vocab_size)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise LlamaMappingError(f"weight mapping mismatch: {str(e).splitlines()[0][:200]}") from None
    return model.eval()
