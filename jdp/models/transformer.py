"""Decoder-only Transformer language model in Flax Linen.

Owns the causal LM, its standard sizes by name (GPT-2's and Llama-family ones among
them), `transformer(size, ...)`, the rotary position embedding, the attention mask of
packed documents, the model's key/value cache for decoding (`decode=True`; the sampling
loop is `decoding.py`'s) and the model-FLOPs count per token. Compute runs in `dtype`
while parameters stay in `param_dtype`; the logits are float32.

One model, with options: the default block is GPT-2's (LayerNorm, GELU MLP, biases);
`norm='rmsnorm'`, `mlp='swiglu'`, `num_kv_heads` (grouped-query attention),
`rotary_base` and `use_bias=False` make it Llama's. Every option's params carry the
logical axis names of `axes.py`: with `parallel.model_parallel` the heads, the MLP's
hidden units and the vocabulary are split over the model axis.
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from jdp.models import axes
from jdp.models.remat import maybe_remat, remat_policy
from jdp.models.vit import MlpBlock

# The options that make the block Llama's.
LLAMA: dict[str, Any] = dict(norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=False,
                             rotary_base=500_000.0)

TRANSFORMER_SIZES: dict[str, dict[str, Any]] = {
    # For quick CPU runs on the built-in addition task.
    "nano": dict(hidden_size=64, num_layers=2, num_heads=4, mlp_dim=256),
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, mlp_dim=512),
    "small": dict(hidden_size=384, num_layers=6, num_heads=6, mlp_dim=1536),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072),
    # GPT-2's architecture (Radford et al., 2019): 64-dim heads, learned positions and the
    # head tied to the token embedding. gpt2_small with vocab_size=50257 and max_len=1024
    # is GPT-2 small, 124,439,808 parameters; the two below are for CPU runs.
    "gpt2_micro": dict(hidden_size=128, num_layers=4, num_heads=2, mlp_dim=512,
                       positions="learned", tie_embeddings=True),
    "gpt2_mini": dict(hidden_size=384, num_layers=6, num_heads=6, mlp_dim=1536,
                      positions="learned", tie_embeddings=True),
    "gpt2_small": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072,
                       positions="learned", tie_embeddings=True),
    # Llama's block (Touvron et al., 2023): RMSNorm, SwiGLU MLP, grouped-query attention
    # (4 query heads per key/value head), no biases, an untied head and Llama 3's rotary
    # base. For CPU runs; the names say the size, not a published checkpoint.
    "llama_micro": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        mlp_dim=384, **LLAMA),
    "llama_mini": dict(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
                       mlp_dim=1024, **LLAMA),
}

POSITIONS = ("rotary", "learned")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")

# The base of RoPE's geometric sequence of frequencies (Su et al., 2021).
ROTARY_BASE = 10_000.0


def apply_rotary(x: jnp.ndarray, positions: jnp.ndarray,
                 base: float = ROTARY_BASE) -> jnp.ndarray:
    """Rotary position embedding of `x` [..., length, heads, head_dim] at `positions`.

    `positions` is [length] (shared by the batch) or [batch, length] (per example, as in
    packed text where they restart at every document). Rotates the pairs (x[i],
    x[i + head_dim/2]) by the angle position * base^(-2i/head_dim), so the dot product of a
    rotated query and key depends only on their offset (the halves convention of GPT-NeoX
    and Llama in `transformers`, not GPT-J's interleaved pairs). The angles and rotation
    are computed in float32 (in bf16 the angles of later positions would be off by whole
    radians) and the result is cast back to x's dtype.
    """
    half = x.shape[-1] // 2
    inverse_frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies  # [..., length, half]
    # Broadcast over heads, which come between length and head_dim.
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention_mask(length: int, segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """Query q may attend to key k iff k <= q and, given `segment_ids`, both are one document.

    [1, 1, length, length] without `segment_ids`, else [batch, 1, length, length]; it
    broadcasts over heads. Padding (segment 0) attends only to padding, and every query
    keeps at least itself, so no softmax row is empty.
    """
    mask = nn.make_causal_mask(jnp.ones(length, jnp.bool_))[None]
    if segment_ids is not None:
        mask = nn.combine_masks(mask, nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))
    return mask


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with optional RoPE and, when `decode`, a key/value cache.

    The parameters are nn.MultiHeadDotProductAttention's (`query`, `key`, `value` project to
    [heads, head_dim], `out` projects back), so params of either load into the other. With
    `num_kv_heads` < `num_heads` (grouped-query attention) `key` and `value` project to
    [num_kv_heads, head_dim] and query head h attends with key/value head
    h // (num_heads / num_kv_heads), as Llama's `repeat_kv` groups them. flax's own
    decode mode does not fit: it takes one token per call (no prefill of a prompt) and
    caches the keys before `attention_fn`, where RoPE would rotate the whole cache again
    at every step. Here keys are rotated at their true positions once, then cached.

    The cache is the 'cache' collection: `cached_key` and `cached_value` [batch, cache
    length, kv heads, head_dim]. The first call with `decode` (`init`, no cache yet)
    creates them as zeros the size of its input and attends as without a cache; later
    calls write their keys and values at `cache_index` and attend to the cache's first
    `cache_index + t + 1` entries from their t-th query.
    """

    num_heads: int
    rotary: bool
    dtype: Any
    param_dtype: Any
    decode: bool = False
    num_kv_heads: int = 0  # 0: num_heads
    rotary_base: float = ROTARY_BASE
    use_bias: bool = True

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        mask: jnp.ndarray | None,
        positions: jnp.ndarray,
        cache_index: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        features = x.shape[-1]
        head_dim = features // self.num_heads
        kv_heads = self.num_kv_heads or self.num_heads
        def dense(heads: int, heads_name: str, name: str) -> nn.DenseGeneral:
            # Column-parallel: split over the model axis by heads.
            return nn.DenseGeneral(
                features=(heads, head_dim), axis=-1, use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=axes.kernel(axes.EMBED, heads_name, axes.HEAD_DIM),
                bias_init=axes.bias(heads_name, axes.HEAD_DIM), name=name)

        query = dense(self.num_heads, axes.HEADS, "query")(x)
        key = dense(kv_heads, axes.KV_HEADS, "key")(x)
        value = dense(kv_heads, axes.KV_HEADS, "value")(x)
        if self.rotary:
            query = apply_rotary(query, positions, self.rotary_base)
            key = apply_rotary(key, positions, self.rotary_base)
        if self.decode:
            cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
            cached_value = self.variable(
                "cache", "cached_value", jnp.zeros, value.shape, value.dtype
            )
            if cache_index is not None:
                start = (0, cache_index, 0, 0)
                key = lax.dynamic_update_slice(cached_key.value, key, start)
                value = lax.dynamic_update_slice(cached_value.value, value, start)
                cached_key.value, cached_value.value = key, value
                # Causal over the cache; its entries past the last written one are zeros.
                query_slots = cache_index + jnp.arange(x.shape[-2])
                mask = (jnp.arange(key.shape[-3]) <= query_slots[:, None])[None, None]
        if kv_heads != self.num_heads:  # each key/value head serves a group of query heads
            key = jnp.repeat(key, self.num_heads // kv_heads, axis=-2)
            value = jnp.repeat(value, self.num_heads // kv_heads, axis=-2)
        # The softmax runs in float32 and its weights are cast back to the value dtype, so
        # both matmuls run in `dtype` (see vit._attention for why).
        weights = nn.dot_product_attention_weights(
            query, key, mask=mask, dtype=self.dtype, force_fp32_for_softmax=True
        )
        y = jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)
        return nn.DenseGeneral(  # row-parallel: the heads' sum is the block's all-reduce
            features, axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=axes.kernel(axes.HEADS, axes.HEAD_DIM, axes.EMBED),
            bias_init=axes.bias(axes.EMBED), name="out"
        )(y)


class SwiGluMlp(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)) (Shazeer, 2020), dropout after it."""

    mlp_dim: int
    dropout_rate: float
    dtype: Any
    param_dtype: Any
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        dense = functools.partial(nn.Dense, use_bias=self.use_bias, dtype=self.dtype,
                                  param_dtype=self.param_dtype)
        # gate and up column-parallel, down row-parallel over the model axis.
        hidden = functools.partial(dense, self.mlp_dim,
                                   kernel_init=axes.kernel(axes.EMBED, axes.MLP),
                                   bias_init=axes.bias(axes.MLP))
        y = nn.silu(hidden(name="gate")(x)) * hidden(name="up")(x)
        y = dense(x.shape[-1], kernel_init=axes.kernel(axes.MLP, axes.EMBED),
                  bias_init=axes.bias(axes.EMBED), name="down")(y)
        return nn.Dropout(self.dropout_rate)(y, deterministic=not train)


def _norm(kind: str, epsilon: float, dtype: Any, param_dtype: Any,
          name: str | None = None) -> nn.Module:
    """A norm of `kind`; without `name`, auto-named (LayerNorm_0, RMSNorm_0, ...)."""
    if kind == "layernorm":
        return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                            **axes.norm_inits())
    return nn.RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                      **axes.norm_inits(use_bias=False))


class DecoderBlock(nn.Module):
    """Pre-norm block: x + CausalAttn(Norm(x)), then x + MLP(Norm(x))."""

    num_heads: int
    mlp_dim: int
    rotary: bool
    dropout_rate: float
    dtype: Any
    param_dtype: Any
    decode: bool = False
    num_kv_heads: int = 0
    rotary_base: float = ROTARY_BASE
    norm: str = "layernorm"
    norm_epsilon: float = 1e-6
    mlp: str = "gelu"
    use_bias: bool = True

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        train: bool,
        mask: jnp.ndarray | None,
        positions: jnp.ndarray,
        cache_index: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        norm = functools.partial(_norm, self.norm, self.norm_epsilon, self.dtype,
                                 self.param_dtype)
        y = norm()(x)
        # Named as the nn.MultiHeadDotProductAttention it replaced, whose params it has.
        y = CausalSelfAttention(
            num_heads=self.num_heads,
            rotary=self.rotary,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            decode=self.decode,
            num_kv_heads=self.num_kv_heads,
            rotary_base=self.rotary_base,
            use_bias=self.use_bias,
            name="MultiHeadDotProductAttention_0",
        )(y, mask, positions, cache_index)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        x = x + y
        y = norm()(x)
        if self.mlp == "swiglu":
            y = SwiGluMlp(self.mlp_dim, self.dropout_rate, self.dtype, self.param_dtype,
                          self.use_bias)(y, train)
        else:
            y = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, self.param_dtype,
                         self.use_bias)(y, train)
        return x + y


class Transformer(nn.Module):
    """Causal language model over int tokens [batch, length]; returns float32 logits.

    Logits at position t predict token t + 1 from tokens 0..t. For packed text pass
    `segment_ids` [batch, length] (1, 2, ... per document in the window, 0 for padding):
    a token then attends only to earlier tokens of its own document. `positions` [batch,
    length] (restarting at 0 at each document) replace 0..length-1 as the positions of
    RoPE and of the learned embedding. Without either the model computes exactly what it
    did before they existed.

    `positions='rotary'` applies RoPE (base `rotary_base`) to queries and keys in every
    layer, `'learned'` adds a learned absolute embedding of up to `max_len` positions to
    the token embedding. `tie_embeddings` computes the logits with the token embedding's
    transpose instead of a separate `head`. `norm` ('layernorm' or 'rmsnorm', with
    `norm_epsilon`), `mlp` ('gelu' or 'swiglu'), `num_kv_heads` (0: one per query head;
    fewer: grouped-query attention) and `use_bias` (the projections' and head's biases)
    choose the block: the defaults are GPT-2's, `LLAMA` Llama's. `remat` names a policy
    from `REMAT_POLICIES`, applied to each block. Dropout needs `rngs={'dropout': key}`
    when `train`.

    `decode=True` is the same model (the same params) with a key/value cache in the 'cache'
    collection: `init` on tokens [batch, cache length] creates it, then each `apply(...,
    mutable=['cache'])` appends its tokens (a prompt, then one at a time) at the next
    positions and returns their logits. `decoding.generate` drives it.
    """

    vocab_size: int
    max_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    positions: str = "rotary"
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"
    tie_embeddings: bool = False
    decode: bool = False
    num_kv_heads: int = 0
    rotary_base: float = ROTARY_BASE
    norm: str = "layernorm"
    norm_epsilon: float = 1e-6
    mlp: str = "gelu"
    use_bias: bool = True

    def __post_init__(self) -> None:
        # Fail when the model is built from the config, not at the first trace.
        for name, choices in (("positions", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"Unknown {name}={getattr(self, name)!r}. Set `{name}` to one of: "
                    f"{', '.join(choices)}"
                )
        if self.num_kv_heads and (self.num_kv_heads < 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}); change `num_kv_heads` (0: one per query head)"
            )
        remat_policy(self.remat)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}); change `hidden_size` or `num_heads`"
            )
        head_dim = self.hidden_size // self.num_heads
        if self.positions == "rotary" and head_dim % 2:
            raise ValueError(
                f"positions='rotary' rotates pairs of features, so the head dim "
                f"hidden_size / num_heads ({self.hidden_size} / {self.num_heads} = {head_dim}) "
                f"must be even; change `hidden_size` or `num_heads`, or set positions='learned'"
            )
        super().__post_init__()

    def _check_inputs(
        self,
        tokens: jnp.ndarray,
        segment_ids: jnp.ndarray | None,
        positions: jnp.ndarray | None,
    ) -> None:
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(
                f"Sequence length ({length}) exceeds max_len ({self.max_len}); "
                f"raise `max_len` or shorten the sequences"
            )
        for name, feature in (("segment_ids", segment_ids), ("positions", positions)):
            if feature is not None and feature.shape != tokens.shape:
                raise ValueError(
                    f"{name} has shape {feature.shape} but the tokens have shape "
                    f"{tokens.shape}; pass one {name[:-1]} per token"
                )
        if self.decode and segment_ids is not None:
            raise ValueError(
                "decode=True continues one sequence per example, so it takes no segment_ids; "
                "call it without `segment_ids`"
            )

    @nn.compact
    def __call__(
        self,
        tokens: jnp.ndarray,
        segment_ids: jnp.ndarray | None = None,
        positions: jnp.ndarray | None = None,
        *,
        train: bool,
    ) -> jnp.ndarray:
        self._check_inputs(tokens, segment_ids, positions)
        length = tokens.shape[1]
        # The index of the cache's next free entry; None where there is no cache to use
        # (not decoding, or `init` creating the cache).
        cache_index = None
        if self.decode:
            has_cache = self.has_variable("cache", "index")
            index = self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
            if has_cache:
                cache_index = index.value
                index.value = cache_index + length
        if positions is None:
            positions = jnp.arange(length)
            if cache_index is not None:
                positions = positions + cache_index

        embedding = nn.Embed(
            self.vocab_size,
            self.hidden_size,
            embedding_init=axes.named(nn.initializers.normal(stddev=0.02), axes.VOCAB,
                                      axes.EMBED),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="token_embedding",
        )
        x = embedding(tokens)
        if self.positions == "learned":
            position_embedding = self.param(
                "position_embedding",
                axes.named(nn.initializers.normal(stddev=0.02), axes.POSITION, axes.EMBED),
                (self.max_len, self.hidden_size),
                self.param_dtype,
            )
            x = x + position_embedding[positions].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)

        # With a cache each attention layer masks by cache entry itself.
        mask = attention_mask(length, segment_ids) if cache_index is None else None
        # static_argnums=(2,): `train` (self is 0) switches dropout in Python. Decoding runs
        # no backward pass, so remat there would only recompute for nothing.
        block_cls = maybe_remat(
            DecoderBlock, "none" if self.decode else self.remat, static_argnums=(2,)
        )
        for i in range(self.num_layers):
            x = block_cls(
                num_heads=self.num_heads,
                mlp_dim=self.mlp_dim,
                rotary=self.positions == "rotary",
                dropout_rate=self.dropout_rate,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                decode=self.decode,
                num_kv_heads=self.num_kv_heads,
                rotary_base=self.rotary_base,
                norm=self.norm,
                norm_epsilon=self.norm_epsilon,
                mlp=self.mlp,
                use_bias=self.use_bias,
                name=f"decoder_block_{i}",
            )(x, train, mask, positions, cache_index)
        x = _norm(self.norm, self.norm_epsilon, self.dtype, self.param_dtype, "decoder_norm")(x)

        if self.tie_embeddings:
            # GPT-2's head: the logit of token v is the dot product with v's embedding.
            logits = embedding.attend(x)
        else:
            logits = nn.Dense(
                self.vocab_size, use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, kernel_init=axes.kernel(axes.EMBED, axes.VOCAB),
                bias_init=axes.bias(axes.VOCAB), name="head"
            )(x)
        # The loss (log-softmax) is computed in float32 whatever the compute dtype.
        return logits.astype(jnp.float32)


def transformer(size: str, *, vocab_size: int, max_len: int, **kwargs: Any) -> Transformer:
    """The Transformer of a named size; `kwargs` set the other fields (and may override)."""
    if size not in TRANSFORMER_SIZES:
        raise ValueError(
            f"Unknown Transformer size: model.size={size!r}. Set `model.size` to one of: "
            f"{', '.join(TRANSFORMER_SIZES)}"
        )
    return Transformer(
        **{**TRANSFORMER_SIZES[size], **kwargs}, vocab_size=vocab_size, max_len=max_len
    )


def flops_per_token(
    *, hidden_size: int, num_layers: int, mlp_dim: int, vocab_size: int, length: int,
    kv_size: int | None = None, mlp_matrices: int = 2,
) -> float:
    """Model FLOPs of one training step's forward and backward pass, per token.

    The standard count (Kaplan et al., 2020; PaLM's MFU): 6 * N + 12 * num_layers *
    hidden_size * length, where N = num_layers * (4 h^2 + 2 h mlp_dim) + h * vocab_size
    are the weights of the matmuls (q, k, v, out; the two MLP layers; the head; not the
    embedding lookups, biases or norms) at 2 FLOPs per multiply-add forward and 4 backward.
    With grouped-query attention k and v project to `kv_size` (= num_kv_heads * head_dim)
    features instead of h, and a SwiGLU MLP has `mlp_matrices`=3 (gate, up, down).
    With `tie_embeddings` the head is the token embedding's transpose: it is then no
    separate parameter but still a h x vocab_size matmul, so N and the count are the same.
    The second term is the attention scores and weighted values, counted over the full
    length x length square though the causal mask makes half of it zero (and a document
    mask more). It counts no remat recomputation: this is model FLOPs for MFU, not the
    hardware FLOPs done.
    """
    kv_size = hidden_size if kv_size is None else kv_size
    attention = 2 * hidden_size**2 + 2 * hidden_size * kv_size
    matmul_params = (
        num_layers * (attention + mlp_matrices * hidden_size * mlp_dim)
        + hidden_size * vocab_size
    )
    return float(6 * matmul_params + 12 * num_layers * hidden_size * length)
