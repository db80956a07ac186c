"""The causal Transformer as a `transformers` architecture, exactly: GPT-2, GPT-NeoX, Llama.

Owns which configurations of `transformer.Transformer` have an exact equivalent there
(`architecture`), the config.json of each (`hf_config`) and the Transformer of a
config.json (`transformer_fields`), and the weights' names and layouts both ways
(`links`: each tensor of model.safetensors as a function of jdp params, and back). It
is plain numpy: neither `transformers` nor `torch` is imported.

The equivalences, checked against `transformers`' own sources and forward passes:
- GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, GELU (tanh, "gelu_new")
  MLP, biases, the head tied to the token embedding. Conv1D weights are [in, out].
- GPT-NeoX (`GPTNeoXForCausalLM`) with `use_parallel_residual=false` and the whole head
  rotated (`partial_rotary_factor=1`): jdp's rotary default. Both rotate the halves of a
  head (x[i], x[i + d/2]), not interleaved pairs. The fused query_key_value projection
  holds each head's query, key and value one after another.
- Llama (`LlamaForCausalLM`): RMSNorm, SwiGLU, grouped-query attention (query head h uses
  key/value head h // group), rotary base `rope_theta`, no biases.
Linear weights are [out, in] in all but GPT-2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM",
                 "llama": "LlamaForCausalLM"}
# The tanh approximation of GELU (flax's nn.gelu default) under its names in transformers.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# The fields of `Transformer` that fix its architecture and its params' shapes.
FIELDS = ("vocab_size", "max_len", "hidden_size", "num_layers", "num_heads", "mlp_dim",
          "positions", "tie_embeddings", "num_kv_heads", "rotary_base", "norm",
          "norm_epsilon", "mlp", "use_bias")


class NoEquivalent(ValueError):
    """A configuration with no exact equivalent on the other side; names the field."""


def architecture(model: Any) -> str:
    """The `transformers` model_type that computes exactly what `model` (a Transformer)
    computes; NoEquivalent naming the first field that has none."""
    kv_heads = model.num_kv_heads or model.num_heads
    if model.norm == "layernorm" and model.mlp == "gelu":
        if not model.use_bias:
            raise NoEquivalent("model.use_bias=False with norm='layernorm' and mlp='gelu': "
                               "GPT-2 and GPT-NeoX have biases. Fix: use_bias=True, or the "
                               "Llama options (norm='rmsnorm', mlp='swiglu')")
        if kv_heads != model.num_heads:
            raise NoEquivalent(f"model.num_kv_heads={model.num_kv_heads}: GPT-2 and GPT-NeoX "
                               "have no grouped-query attention. Fix: num_kv_heads=0, or the "
                               "Llama options (norm='rmsnorm', mlp='swiglu')")
        if not model.tie_embeddings:
            raise NoEquivalent("model.tie_embeddings=False: the separate head has a bias, "
                               "GPT-2's and GPT-NeoX's have none. Fix: tie_embeddings=True")
        return "gpt2" if model.positions == "learned" else "gpt_neox"
    if model.norm == "rmsnorm" and model.mlp == "swiglu":
        if model.positions != "rotary":
            raise NoEquivalent(f"model.positions={model.positions!r} with the Llama options: "
                               "Llama has rotary positions. Fix: positions='rotary'")
        if model.use_bias and not model.tie_embeddings:
            raise NoEquivalent("model.tie_embeddings=False with use_bias=True: the separate "
                               "head has a bias, Llama's has none. Fix: use_bias=False or "
                               "tie_embeddings=True")
        return "llama"
    field, value = ("mlp", model.mlp) if model.norm == "layernorm" else ("norm", model.norm)
    raise NoEquivalent(f"model.{field}={value!r} with norm={model.norm!r}, mlp={model.mlp!r}: "
                       "no transformers architecture mixes these. Fix: norm='layernorm' with "
                       "mlp='gelu' (GPT-2, GPT-NeoX) or norm='rmsnorm' with mlp='swiglu' (Llama)")


def hf_config(model: Any, *, eos_id: int, bos_id: int | None = None,
              dtype: str = "float32") -> dict:
    """The config.json of `model` (a Transformer) in `transformers`' terms."""
    model_type = architecture(model)
    common = dict(architectures=[ARCHITECTURES[model_type]], model_type=model_type,
                  vocab_size=model.vocab_size, tie_word_embeddings=model.tie_embeddings,
                  eos_token_id=eos_id, bos_token_id=eos_id if bos_id is None else bos_id,
                  pad_token_id=None, dtype=dtype, torch_dtype=dtype, use_cache=True)
    if model_type == "gpt2":
        return {**common, "n_positions": model.max_len, "n_embd": model.hidden_size,
                "n_layer": model.num_layers, "n_head": model.num_heads, "n_inner": model.mlp_dim,
                "activation_function": "gelu_new", "layer_norm_epsilon": model.norm_epsilon,
                "resid_pdrop": model.dropout_rate, "embd_pdrop": model.dropout_rate,
                "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    sizes = dict(hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                 num_attention_heads=model.num_heads, intermediate_size=model.mlp_dim,
                 max_position_embeddings=model.max_len, attention_dropout=0.0)
    if model_type == "gpt_neox":
        # rotary_pct and rotary_emb_base: the same for transformers before 5.
        return {**common, **sizes, "hidden_act": "gelu_new", "layer_norm_eps": model.norm_epsilon,
                "use_parallel_residual": False, "attention_bias": True,
                "hidden_dropout": model.dropout_rate,
                "rope_parameters": {"rope_type": "default", "rope_theta": model.rotary_base,
                                    "partial_rotary_factor": 1.0},
                "rotary_pct": 1.0, "rotary_emb_base": model.rotary_base}
    return {**common, **sizes, "num_key_value_heads": model.num_kv_heads or model.num_heads,
            "head_dim": model.hidden_size // model.num_heads, "hidden_act": "silu",
            "rms_norm_eps": model.norm_epsilon, "attention_bias": model.use_bias,
            "mlp_bias": model.use_bias, "pretraining_tp": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rotary_base},
            "rope_theta": model.rotary_base}


def _refuse(config: dict, key: str, why: str, fix: str) -> NoEquivalent:
    return NoEquivalent(f"{key}={config.get(key)!r} in config.json: {why}. {fix}")


def _rope(config: dict, default_fraction: float) -> tuple[float, float]:
    """(rope_theta, the rotated fraction of a head) from either generation of config.json."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NoEquivalent(f"rope_parameters={rope!r} in config.json: jdp's rotary embedding "
                           "has no scaling (rope_type 'default' only). Fix: import a model "
                           "without RoPE scaling")
    theta = rope.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base",
                                                                        10_000.0)))
    fraction = rope.get("partial_rotary_factor", config.get("rotary_pct", default_fraction))
    return float(theta), float(fraction)


def transformer_fields(config: dict) -> dict[str, Any]:
    """The Transformer fields (`FIELDS`) of a `transformers` config.json; NoEquivalent
    naming the key that jdp cannot compute exactly."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _refuse(config, "model_type", "jdp imports only " + ", ".join(ARCHITECTURES),
                      "Fix: import a GPT-2, GPT-NeoX or Llama checkpoint")
    if model_type == "gpt2":
        if config.get("activation_function", "gelu_new") not in _TANH_GELU:
            raise _refuse(config, "activation_function", "jdp's GELU is the tanh approximation",
                          "Fix: a model with activation_function='gelu_new'")
        for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx",
                                                            False), ("add_cross_attention", False),
                            ("tie_word_embeddings", True)):
            if config.get(key, wanted) != wanted:
                raise _refuse(config, key, "jdp's GPT-2 has no such variant",
                              f"Fix: a model with {key}={wanted}")
        hidden = config.get("n_embd", 768)
        return dict(vocab_size=config["vocab_size"], max_len=config.get("n_positions", 1024),
                    hidden_size=hidden, num_layers=config.get("n_layer", 12),
                    num_heads=config.get("n_head", 12),
                    mlp_dim=config.get("n_inner") or 4 * hidden, positions="learned",
                    tie_embeddings=True, num_kv_heads=0, rotary_base=10_000.0, norm="layernorm",
                    norm_epsilon=config.get("layer_norm_epsilon", 1e-5), mlp="gelu",
                    use_bias=True)
    common = dict(vocab_size=config["vocab_size"],
                  max_len=config.get("max_position_embeddings", 2048),
                  hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                  num_heads=config["num_attention_heads"], mlp_dim=config["intermediate_size"],
                  positions="rotary")
    if model_type == "gpt_neox":
        theta, fraction = _rope(config, 0.25)
        if fraction != 1.0:
            raise NoEquivalent(f"partial_rotary_factor (rotary_pct)={fraction} in config.json: "
                               "jdp rotates whole heads. Fix: a model with rotary_pct=1.0")
        for key, wanted in (("use_parallel_residual", False), ("attention_bias", True),
                            ("tie_word_embeddings", True)):
            if config.get(key, not wanted) != wanted:
                raise _refuse(config, key, "jdp's block has no such variant",
                              f"Fix: a model with {key}={wanted}")
        if config.get("hidden_act", "gelu") not in _TANH_GELU:
            raise _refuse(config, "hidden_act", "jdp's GELU is the tanh approximation",
                          "Fix: a model with hidden_act='gelu_new'")
        return dict(common, tie_embeddings=True, num_kv_heads=0, rotary_base=theta,
                    norm="layernorm", norm_epsilon=config.get("layer_norm_eps", 1e-5),
                    mlp="gelu", use_bias=True)
    theta, _ = _rope(config, 1.0)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config.get("head_dim") not in (None, head_dim):
        raise _refuse(config, "head_dim", f"jdp's heads are hidden_size / num_attention_heads "
                      f"= {head_dim} wide", "Fix: a model with head_dim = hidden_size / heads")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(config, "hidden_act", "jdp's SwiGLU gates with silu",
                      "Fix: a model with hidden_act='silu'")
    use_bias = bool(config.get("attention_bias", False))
    if bool(config.get("mlp_bias", False)) != use_bias:
        raise _refuse(config, "mlp_bias", f"jdp has biases everywhere or nowhere (attention_bias="
                      f"{use_bias})", "Fix: a model with mlp_bias equal to attention_bias")
    tied = bool(config.get("tie_word_embeddings", False))
    if use_bias and not tied:
        raise _refuse(config, "tie_word_embeddings", "jdp's separate head has a bias when the "
                      "projections do", "Fix: a model without biases, or with a tied head")
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return dict(common, tie_embeddings=tied,
                num_kv_heads=0 if kv_heads == config["num_attention_heads"] else kv_heads,
                rotary_base=theta, norm="rmsnorm", norm_epsilon=config.get("rms_norm_eps", 1e-6),
                mlp="swiglu", use_bias=use_bias)


@dataclasses.dataclass(frozen=True)
class Link:
    """One tensor of model.safetensors and the jdp params (by '/'-joined path) it is made
    of: `to_hf(*leaves)` makes it, `from_hf(tensor)` gives the leaves back."""

    name: str
    shape: tuple[int, ...]
    leaves: tuple[str, ...]
    to_hf: Callable[..., np.ndarray]
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]


def _same(name: str, shape: tuple[int, ...], leaf: str) -> Link:
    return Link(name, shape, (leaf,), lambda a: a, lambda t: (t,))


def _transposed(name: str, in_dim: int, out_dim: int, leaf: str) -> Link:
    """A jdp Dense kernel [in, out] as a torch Linear weight [out, in]."""
    return Link(name, (out_dim, in_dim), (leaf,), lambda a: a.T, lambda t: (t.T,))


def _heads_linear(name: str, hidden: int, heads: int, head_dim: int, leaf: str,
                  bias: bool) -> Link:
    """A projection to [heads, head_dim] (kernel [hidden, heads, head_dim] or bias [heads,
    head_dim]) as a Linear's weight [heads * head_dim, hidden] or bias."""
    if bias:
        return Link(name, (heads * head_dim,), (leaf,), lambda a: a.reshape(-1),
                    lambda t: (t.reshape(heads, head_dim),))
    return Link(name, (heads * head_dim, hidden), (leaf,), lambda a: a.reshape(hidden, -1).T,
                lambda t: (t.T.reshape(hidden, heads, head_dim),))


def _out_linear(name: str, hidden: int, heads: int, head_dim: int, leaf: str,
                transpose: bool) -> Link:
    """The attention's output kernel [heads, head_dim, hidden] as [hidden, heads*head_dim]
    (Linear) or, without `transpose`, [heads*head_dim, hidden] (GPT-2's Conv1D)."""
    if transpose:
        return Link(name, (hidden, heads * head_dim), (leaf,),
                    lambda a: a.reshape(-1, hidden).T,
                    lambda t: (t.T.reshape(heads, head_dim, hidden),))
    return Link(name, (heads * head_dim, hidden), (leaf,), lambda a: a.reshape(-1, hidden),
                lambda t: (t.reshape(heads, head_dim, hidden),))


def _norm_links(hf: str, jdp: str, hidden: int, bias: bool) -> list[Link]:
    links = [_same(f"{hf}.weight", (hidden,), f"{jdp}/scale")]
    return links + [_same(f"{hf}.bias", (hidden,), f"{jdp}/bias")] if bias else links


def _gpt2_layer(i: int, f: dict) -> list[Link]:
    hidden, heads, mlp = f["hidden_size"], f["num_heads"], f["mlp_dim"]
    hf, jdp = f"transformer.h.{i}", f"decoder_block_{i}"
    attention = f"{jdp}/MultiHeadDotProductAttention_0"
    qkv = tuple(f"{attention}/{part}" for part in ("query", "key", "value"))

    def fused(suffix: str, hf_suffix: str, shape: tuple[int, ...]) -> Link:
        leading = shape[:-1]  # Conv1D: q, k and v side by side in the last axis
        return Link(f"{hf}.attn.c_attn.{hf_suffix}", shape, tuple(f"{p}/{suffix}" for p in qkv),
                    lambda *a: np.concatenate([x.reshape(*leading, -1) for x in a], axis=-1),
                    lambda t: tuple(x.reshape(*leading, heads, -1)
                                    for x in np.split(t, 3, axis=-1)))

    return [*_norm_links(f"{hf}.ln_1", f"{jdp}/LayerNorm_0", hidden, True),
            fused("kernel", "weight", (hidden, 3 * hidden)), fused("bias", "bias", (3 * hidden,)),
            _out_linear(f"{hf}.attn.c_proj.weight", hidden, heads, hidden // heads,
                        f"{attention}/out/kernel", transpose=False),
            _same(f"{hf}.attn.c_proj.bias", (hidden,), f"{attention}/out/bias"),
            *_norm_links(f"{hf}.ln_2", f"{jdp}/LayerNorm_1", hidden, True),
            _same(f"{hf}.mlp.c_fc.weight", (hidden, mlp), f"{jdp}/MlpBlock_0/Dense_0/kernel"),
            _same(f"{hf}.mlp.c_fc.bias", (mlp,), f"{jdp}/MlpBlock_0/Dense_0/bias"),
            _same(f"{hf}.mlp.c_proj.weight", (mlp, hidden), f"{jdp}/MlpBlock_0/Dense_1/kernel"),
            _same(f"{hf}.mlp.c_proj.bias", (hidden,), f"{jdp}/MlpBlock_0/Dense_1/bias")]


def _neox_layer(i: int, f: dict) -> list[Link]:
    hidden, heads, mlp = f["hidden_size"], f["num_heads"], f["mlp_dim"]
    head_dim = hidden // heads
    hf, jdp = f"gpt_neox.layers.{i}", f"decoder_block_{i}"
    attention = f"{jdp}/MultiHeadDotProductAttention_0"
    qkv = tuple(f"{attention}/{part}" for part in ("query", "key", "value"))
    # Per head: its query, key and value rows one after another ([heads, 3, head_dim]).
    weight = Link(f"{hf}.attention.query_key_value.weight", (3 * hidden, hidden),
                  tuple(f"{p}/kernel" for p in qkv),
                  lambda *a: np.stack(a, axis=2).reshape(hidden, -1).T,
                  lambda t: tuple(np.moveaxis(t.T.reshape(hidden, heads, 3, head_dim), 2, 0)))
    bias = Link(f"{hf}.attention.query_key_value.bias", (3 * hidden,),
                tuple(f"{p}/bias" for p in qkv), lambda *a: np.stack(a, axis=1).reshape(-1),
                lambda t: tuple(np.moveaxis(t.reshape(heads, 3, head_dim), 1, 0)))
    mlp_jdp = f"{jdp}/MlpBlock_0"
    return [*_norm_links(f"{hf}.input_layernorm", f"{jdp}/LayerNorm_0", hidden, True),
            weight, bias,
            _out_linear(f"{hf}.attention.dense.weight", hidden, heads, head_dim,
                        f"{attention}/out/kernel", transpose=True),
            _same(f"{hf}.attention.dense.bias", (hidden,), f"{attention}/out/bias"),
            *_norm_links(f"{hf}.post_attention_layernorm", f"{jdp}/LayerNorm_1", hidden, True),
            _transposed(f"{hf}.mlp.dense_h_to_4h.weight", hidden, mlp, f"{mlp_jdp}/Dense_0/kernel"),
            _same(f"{hf}.mlp.dense_h_to_4h.bias", (mlp,), f"{mlp_jdp}/Dense_0/bias"),
            _transposed(f"{hf}.mlp.dense_4h_to_h.weight", mlp, hidden, f"{mlp_jdp}/Dense_1/kernel"),
            _same(f"{hf}.mlp.dense_4h_to_h.bias", (hidden,), f"{mlp_jdp}/Dense_1/bias")]


def _llama_layer(i: int, f: dict) -> list[Link]:
    hidden, heads, mlp, bias = f["hidden_size"], f["num_heads"], f["mlp_dim"], f["use_bias"]
    kv_heads, head_dim = f["num_kv_heads"] or heads, hidden // heads
    hf, jdp = f"model.layers.{i}", f"decoder_block_{i}"
    attention = f"{jdp}/MultiHeadDotProductAttention_0"
    links = [*_norm_links(f"{hf}.input_layernorm", f"{jdp}/RMSNorm_0", hidden, False),
             *_norm_links(f"{hf}.post_attention_layernorm", f"{jdp}/RMSNorm_1", hidden, False),
             _out_linear(f"{hf}.self_attn.o_proj.weight", hidden, heads, head_dim,
                         f"{attention}/out/kernel", transpose=True)]
    for part, hf_part, count in (("query", "q_proj", heads), ("key", "k_proj", kv_heads),
                                 ("value", "v_proj", kv_heads)):
        for suffix, hf_suffix in (("kernel", "weight"), ("bias", "bias"))[:1 + bias]:
            links.append(_heads_linear(f"{hf}.self_attn.{hf_part}.{hf_suffix}", hidden, count,
                                       head_dim, f"{attention}/{part}/{suffix}",
                                       suffix == "bias"))
    mlp_jdp = f"{jdp}/SwiGluMlp_0"
    links += [_transposed(f"{hf}.mlp.gate_proj.weight", hidden, mlp, f"{mlp_jdp}/gate/kernel"),
              _transposed(f"{hf}.mlp.up_proj.weight", hidden, mlp, f"{mlp_jdp}/up/kernel"),
              _transposed(f"{hf}.mlp.down_proj.weight", mlp, hidden, f"{mlp_jdp}/down/kernel")]
    if bias:
        links += [_same(f"{hf}.self_attn.o_proj.bias", (hidden,), f"{attention}/out/bias"),
                  _same(f"{hf}.mlp.gate_proj.bias", (mlp,), f"{mlp_jdp}/gate/bias"),
                  _same(f"{hf}.mlp.up_proj.bias", (mlp,), f"{mlp_jdp}/up/bias"),
                  _same(f"{hf}.mlp.down_proj.bias", (hidden,), f"{mlp_jdp}/down/bias")]
    return links


# model_type -> (token embedding, position embedding, final norm, untied head, layer links)
_LAYOUTS = {
    "gpt2": ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f",
             "lm_head.weight", _gpt2_layer),
    "gpt_neox": ("gpt_neox.embed_in.weight", None, "gpt_neox.final_layer_norm",
                 "embed_out.weight", _neox_layer),
    "llama": ("model.embed_tokens.weight", None, "model.norm", "lm_head.weight", _llama_layer),
}
# Where transformers 5 saves or reads another name for a tensor than the one written here.
ALIASES = {"embed_out.weight": "lm_head.weight"}


def links(model_type: str, fields: dict[str, Any]) -> list[Link]:
    """Every tensor of the model.safetensors of a Transformer with `fields` (`FIELDS`) as
    `model_type`, in the order written."""
    embedding, positions, final_norm, head, layer = _LAYOUTS[model_type]
    hidden, vocab = fields["hidden_size"], fields["vocab_size"]
    result = [_same(embedding, (vocab, hidden), "token_embedding/embedding")]
    if positions is not None:
        result.append(_same(positions, (fields["max_len"], hidden), "position_embedding"))
    for i in range(fields["num_layers"]):
        result += layer(i, fields)
    result += _norm_links(final_norm, "decoder_norm", hidden, fields["norm"] == "layernorm")
    if not fields["tie_embeddings"]:
        result.append(_transposed(head, hidden, vocab, "head/kernel"))
    return result


def model_fields(model: Any) -> dict[str, Any]:
    """`FIELDS` of a Transformer."""
    return {name: getattr(model, name) for name in FIELDS}
