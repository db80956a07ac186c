"""The Transformer on packed text (document masks, restarting positions, tied embeddings,
GPT-2 sizes) and cached autoregressive decoding (`jdp.models.decoding`)."""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp.models import decoding
from jdp.models.transformer import Transformer, flops_per_token, transformer
from jdp.models.vit import MlpBlock

VOCAB_SIZE = 16
MAX_LEN = 24
LENGTH = 16
SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64)
# Two documents packed in one window: 6 tokens of document 1, then 10 of document 2.
DOC1 = 6
SEGMENT_IDS = jnp.array([[1] * DOC1 + [2] * (LENGTH - DOC1)] * 2, jnp.int32)
POSITIONS = jnp.array([list(range(DOC1)) + list(range(LENGTH - DOC1))] * 2, jnp.int32)
ONE_DOCUMENT = jnp.ones_like(SEGMENT_IDS)
ARANGE = jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH))

# Compiling dominates these tests (see test_lm_parts): each program is compiled once, and
# all forward passes are [2, LENGTH] so they share it.


def _model(**kwargs: Any) -> Transformer:
    return Transformer(**{"vocab_size": VOCAB_SIZE, "max_len": MAX_LEN, **SMALL, **kwargs})


def _tokens(seed: int = 0) -> jnp.ndarray:
    # numpy's generator: jax.random would compile a program for each shape.
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB_SIZE, (2, LENGTH)),
                       jnp.int32)


@functools.cache
def _variables(positions: str) -> dict:
    """Initial variables. The learned model's are the rotary model's plus a position
    embedding drawn as its init does, which saves compiling a second init."""
    if positions == "learned":
        table = np.random.default_rng(1).normal(0, 0.02, (MAX_LEN, SMALL["hidden_size"]))
        params = _variables("rotary")["params"]
        return {"params": {**params, "position_embedding": jnp.asarray(table, jnp.float32)}}
    model = _model(positions=positions)
    return jax.jit(lambda key: nn.unbox(model.init(key, _tokens(), train=False)))(
        jax.random.key(1, impl="rbg"))


@functools.cache
def _forward(positions: str, packed: bool):
    """The compiled inference pass, with segment ids and positions if `packed`."""
    model = _model(positions=positions)
    if packed:
        return jax.jit(lambda variables, tokens, segment_ids, token_positions: model.apply(
            variables, tokens, segment_ids, token_positions, train=False))
    return jax.jit(lambda variables, tokens: model.apply(variables, tokens, train=False))


def _logits(positions: str, tokens, segment_ids=None, token_positions=None) -> jax.Array:
    if segment_ids is None:
        assert token_positions is None
        return _forward(positions, False)(_variables(positions), tokens)
    return _forward(positions, True)(_variables(positions), tokens, segment_ids, token_positions)


# --- packed documents ----------------------------------------------------------


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_changing_document_1_leaves_document_2_logits_unchanged(positions):
    tokens = _tokens()
    changed = tokens.at[:, :DOC1].set((tokens[:, :DOC1] + 1) % VOCAB_SIZE)
    before = _logits(positions, tokens, SEGMENT_IDS, POSITIONS)
    after = _logits(positions, changed, SEGMENT_IDS, POSITIONS)
    np.testing.assert_allclose(after[:, DOC1:], before[:, DOC1:], atol=1e-6)
    assert np.abs(after[:, :DOC1] - before[:, :DOC1]).max() > 1e-3
    # As one document, document 2 attends to document 1: the test above can fail.
    unmasked_before = _logits(positions, tokens, ONE_DOCUMENT, POSITIONS)
    unmasked_after = _logits(positions, changed, ONE_DOCUMENT, POSITIONS)
    assert (np.abs(unmasked_after[:, DOC1:] - unmasked_before[:, DOC1:]).max(-1) > 1e-4).all()


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_document_2_packed_after_document_1_has_its_logits_when_alone(positions):
    tokens = _tokens()
    packed = _logits(positions, tokens, SEGMENT_IDS, POSITIONS)[:, DOC1:]
    # Document 2 at the start of a sequence; what follows it does not change its logits.
    alone = _logits(positions, jnp.roll(tokens, -DOC1, axis=1))[:, : LENGTH - DOC1]
    # Rotary angles of positions 0.. and DOC1.. differ, so rounding does too.
    np.testing.assert_allclose(packed, alone, atol=1e-5)
    if positions == "learned":
        # Positions that do not restart give document 2 other position embeddings.
        not_restarted = _logits(positions, tokens, SEGMENT_IDS, ARANGE)[:, DOC1:]
        assert np.abs(not_restarted - alone).max() > 1e-3


def test_segment_ids_of_another_shape_name_the_field_and_both_shapes():
    with pytest.raises(ValueError, match=r"segment_ids has shape \(1, 16\).*\(2, 16\)"):
        _logits("rotary", _tokens(), SEGMENT_IDS[:1], POSITIONS)


# --- the unchanged default path ----------------------------------------------------------


def _reference_rotary(x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    inverse_frequencies = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inverse_frequencies
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def _reference_attention(query, key, value, mask, dtype=None, rotary=False):
    if rotary:
        positions = jnp.arange(query.shape[-3])
        query, key = _reference_rotary(query, positions), _reference_rotary(key, positions)
    weights = nn.dot_product_attention_weights(
        query, key, mask=mask, dtype=dtype, force_fp32_for_softmax=True)
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


class _ReferenceBlock(nn.Module):
    """The decoder block as it was before packed text: flax's own attention module."""

    num_heads: int
    mlp_dim: int
    rotary: bool

    @nn.compact
    def __call__(self, x):
        causal_mask = nn.make_causal_mask(jnp.ones(x.shape[1], jnp.bool_))[None]
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            attention_fn=functools.partial(_reference_attention, rotary=self.rotary),
        )(y, y, mask=causal_mask)
        x = x + y
        return x + MlpBlock(self.mlp_dim, 0.0, None, jnp.float32)(nn.LayerNorm()(x), False)


class _ReferenceTransformer(nn.Module):
    """The Transformer as it was before packed text, float32 without dropout or remat."""

    positions: str

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB_SIZE, SMALL["hidden_size"], name="token_embedding",
                     embedding_init=nn.initializers.normal(stddev=0.02))(tokens)
        if self.positions == "learned":
            table = self.param("position_embedding", nn.initializers.normal(stddev=0.02),
                               (MAX_LEN, SMALL["hidden_size"]))
            x = x + table[: tokens.shape[1]]
        for i in range(SMALL["num_layers"]):
            x = _ReferenceBlock(SMALL["num_heads"], SMALL["mlp_dim"],
                                self.positions == "rotary", name=f"decoder_block_{i}")(x)
        x = nn.LayerNorm(name="decoder_norm")(x)
        return nn.Dense(VOCAB_SIZE, name="head")(x)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_without_segment_ids_and_positions_the_model_is_the_one_before_them(positions):
    tokens, variables = _tokens(seed=3), _variables(positions)
    reference = _ReferenceTransformer(positions)
    reference_shapes = jax.eval_shape(lambda: nn.unbox(reference.init(jax.random.key(0), tokens)))
    shapes = lambda tree: jax.tree.map(lambda leaf: leaf.shape, tree)
    assert shapes(reference_shapes) == shapes(variables)  # checkpoints load either way
    expected = jax.jit(reference.apply)(variables, tokens)
    np.testing.assert_allclose(_logits(positions, tokens), expected, rtol=1e-6, atol=1e-6)
    # One document at positions 0.. is the same computation.
    np.testing.assert_allclose(_logits(positions, tokens, ONE_DOCUMENT, ARANGE), expected,
                               rtol=1e-6, atol=1e-6)


# --- GPT-2 sizes, tied embeddings, FLOPs -------------------------------------------


def test_gpt2_small_has_gpt2_smalls_124m_parameters_and_no_head():
    model = transformer("gpt2_small", vocab_size=50257, max_len=1024)
    params = jax.eval_shape(
        lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
                                    train=False))
    )["params"]
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 124_439_808
    assert "head" not in params and params["position_embedding"].shape == (1024, 768)
    assert (model.positions, model.tie_embeddings) == ("learned", True)


def _tied_params() -> dict:
    """The rotary model's params less its head: the params of the tied model."""
    return {k: v for k, v in _variables("rotary")["params"].items() if k != "head"}


def test_tied_embeddings_compute_the_logits_with_the_token_embedding():
    model, params = _model(tie_embeddings=True), _tied_params()
    params_shapes = jax.eval_shape(
        lambda: nn.unbox(model.init(jax.random.key(0), _tokens(), train=False)))["params"]
    assert jax.tree.structure(params_shapes) == jax.tree.structure(params)  # no head
    logits, state = jax.jit(lambda p: model.apply(
        {"params": p}, _tokens(), train=False, capture_intermediates=True,
        mutable=["intermediates"]))(params)
    final_hidden = state["intermediates"]["decoder_norm"]["__call__"][0]
    embedding = params["token_embedding"]["embedding"]
    np.testing.assert_allclose(logits, final_hidden @ embedding.T, rtol=1e-5, atol=1e-6)


def test_flops_per_token_counts_the_tied_head_matmul():
    # GPT-2 small by hand: per layer 4 h^2 (q, k, v, out) + 2 h * mlp; the head h * vocab.
    hidden, layers, mlp, vocab, length = 768, 12, 3072, 50257, 1024
    matmul_weights = layers * (4 * hidden**2 + 2 * hidden * mlp) + hidden * vocab
    assert matmul_weights == 123_532_032
    expected = 6 * matmul_weights + 12 * layers * hidden * length
    assert expected == 854_438_400
    assert flops_per_token(hidden_size=hidden, num_layers=layers, mlp_dim=mlp,
                           vocab_size=vocab, length=length) == expected
    # The tied model has no head kernel: its matmul weights are the kernels plus the embedding.
    params = _tied_params()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    kernels = sum(leaf.size for path, leaf in leaves if path[-1].key == "kernel")
    tied = kernels + params["token_embedding"]["embedding"].size
    h, n = SMALL["hidden_size"], SMALL["num_layers"]
    assert flops_per_token(hidden_size=h, num_layers=n, mlp_dim=SMALL["mlp_dim"],
                           vocab_size=VOCAB_SIZE, length=LENGTH) == 6 * tied + 12 * n * h * LENGTH


# --- the key/value cache ----------------------------------------------------------


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_cached_decoding_gives_the_full_forward_logits_at_every_position(positions):
    model, variables, tokens = _model(positions=positions), _variables(positions), _tokens(4)
    decoder = model.clone(decode=True)
    decoder_variables = jax.eval_shape(lambda: nn.unbox(decoder.init(jax.random.key(0), tokens,
                                                                      train=False)))
    shapes = lambda tree: jax.tree.map(lambda leaf: leaf.shape, tree)
    assert shapes(decoder_variables["params"]) == shapes(variables["params"])  # same params
    assert set(decoder_variables) == {"params", "cache"} and set(variables) == {"params"}

    def append(cache, chunk):
        logits, updated = decoder.apply({"params": variables["params"], "cache": cache}, chunk,
                                        train=False, mutable=["cache"])
        return updated["cache"], logits

    @jax.jit
    def cached_logits(tokens):
        # A prompt of 5, a chunk of 2, then one token at a time.
        cache, prompt = append(decoding.init_cache(model, 2, LENGTH), tokens[:, :5])
        cache, chunk = append(cache, tokens[:, 5:7])
        cache, steps = jax.lax.scan(append, cache, tokens[:, 7:, None].swapaxes(0, 1))
        steps = steps[:, :, 0].swapaxes(0, 1)
        return cache["index"], jnp.concatenate([prompt, chunk, steps], axis=1)

    index, logits = cached_logits(tokens)
    assert int(index) == LENGTH
    np.testing.assert_allclose(logits, _logits(positions, tokens), rtol=1e-5, atol=1e-5)


# --- generate ---------------------------------------------------------------------

SEPARATOR = 0
COPY = 5  # a copy document: COPY tokens, SEPARATOR, the same COPY tokens
DOCUMENT = 2 * COPY + 1
# Generating compiles the model twice (prefill and step) with XLA's optimisations: one
# layer halves that, and one layer can copy (attend a fixed offset back, easy with RoPE).
_decoder = functools.partial(_model, num_layers=1)


def _untrained_params() -> dict:
    """The rotary model's params less its second layer: one-layer params (no compile)."""
    return {k: v for k, v in _variables("rotary")["params"].items() if k != "decoder_block_1"}


def _copy_documents(content: jnp.ndarray) -> jnp.ndarray:
    """Documents [count, DOCUMENT] copying `content` [count, COPY] of tokens > SEPARATOR."""
    separators = jnp.full((content.shape[0], 1), SEPARATOR, content.dtype)
    return jnp.concatenate([content, separators, content], axis=1)


@pytest.fixture(scope="module")
def copy_params() -> dict:
    """The one-layer model trained with adam on windows of two packed copy documents.

    Its loss is near zero after 50 steps; compiling the training takes most of its time.
    """
    model, optimizer, batch_size = _decoder(), optax.adam(1e-2), 32
    segment_ids = jnp.repeat(jnp.array([1, 2]), DOCUMENT)[None, :-1].repeat(batch_size, 0)
    positions = jnp.tile(jnp.arange(DOCUMENT), 2)[None, :-1].repeat(batch_size, 0)
    # The loss is on the copies: the targets from each separator to the document's end.
    in_document = jnp.arange(DOCUMENT)
    weights = jnp.tile((in_document >= COPY) & (in_document < DOCUMENT - 1), 2)[:-1]

    def loss(params, window):
        logits = model.apply({"params": params}, window[:, :-1], segment_ids, positions,
                             train=False)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:])
        return (losses * weights).sum() / (weights.sum() * batch_size)

    def train_step(state, key):
        params, opt_state = state
        content = jax.random.randint(key, (2 * batch_size, COPY), 1, VOCAB_SIZE)
        window = _copy_documents(content).reshape(batch_size, 2 * DOCUMENT)
        updates, opt_state = optimizer.update(jax.grad(loss)(params, window), opt_state)
        return (optax.apply_updates(params, updates), opt_state), None

    @jax.jit
    def train(params):
        keys = jax.random.split(jax.random.key(7), 100)
        return jax.lax.scan(train_step, (params, optimizer.init(params)), keys)[0][0]

    return train(_untrained_params())


# Copy prompts: COPY tokens and the separator. All generate calls but one share this shape.
PROMPTS = np.concatenate([np.random.default_rng(99).integers(1, VOCAB_SIZE, (8, COPY)),
                          np.full((8, 1), SEPARATOR)], axis=1).astype(np.int32)


def test_greedy_decoding_of_a_model_trained_to_copy_writes_the_copy(copy_params):
    new_tokens = decoding.generate(_decoder(), copy_params, PROMPTS, max_new_tokens=COPY,
                                   temperature=0)
    np.testing.assert_array_equal(new_tokens, PROMPTS[:, :COPY])


def test_decoding_stops_at_eos(copy_params):
    generate = functools.partial(decoding.generate, _decoder(), copy_params,
                                 max_new_tokens=COPY, temperature=0, eos_id=7)
    # One prompt: the new tokens end with the first eos.
    np.testing.assert_array_equal(generate([3, 7, 9, 7, 4, SEPARATOR]), [3, 7])
    # A batch: each row's tokens after its first eos are eos too.
    prompts = PROMPTS.copy()
    prompts[0, :COPY] = [3, 7, 9, 7, 4]
    prompts[1:, :COPY] = np.where(prompts[1:, :COPY] == 7, 8, prompts[1:, :COPY])
    new_tokens = generate(prompts)
    np.testing.assert_array_equal(new_tokens[0], [3, 7, 7, 7, 7])
    np.testing.assert_array_equal(new_tokens[1:], prompts[1:, :COPY])


def test_the_same_seed_gives_the_same_sample_and_another_seed_another():
    sample = functools.partial(decoding.generate, _decoder(), _untrained_params(), PROMPTS,
                               max_new_tokens=COPY, temperature=1.0)
    first = sample(seed=0)
    assert first.shape == (len(PROMPTS), COPY) and first.dtype == np.int32
    np.testing.assert_array_equal(sample(seed=0), first)
    assert (sample(seed=1) != first).any()


def test_top_k_1_is_greedy():
    sample = functools.partial(decoding.generate, _decoder(), _untrained_params(), PROMPTS,
                               max_new_tokens=COPY)
    np.testing.assert_array_equal(sample(temperature=1.0, top_k=1, seed=3),
                                  sample(temperature=0))


def test_learned_positions_refuse_a_prompt_and_tokens_past_max_len():
    with pytest.raises(ValueError, match=r"\(20\) \+ max_new_tokens \(6\) - 1 = 25 exceeds "
                                         r"max_len \(24\)"):
        decoding.generate(_model(positions="learned"), _variables("learned")["params"],
                          np.zeros(20, np.int32), max_new_tokens=6)


# --- sampling past the context (jdp.sample) ---------------------------------------


class _IdsTokenizer:
    """Text of space-separated token ids; eos VOCAB_SIZE - 1."""

    eos_id = VOCAB_SIZE - 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([int(t) for t in text.split()], np.int32)

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids if int(i) != self.eos_id)


def _window_by_window_greedy(model, params, prompt: list[int], count: int) -> list[int]:
    """jdp.sample's sliding window, one full forward pass per token: the first window
    continues the prompt up to max_len tokens; each next one rereads the last max_len // 2
    tokens and writes up to max_len // 2 + 1."""
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens, train=False))

    def next_logits(sequence: list[int]) -> jax.Array:  # one program: padded at the end
        padded = sequence + [0] * (model.max_len - len(sequence))
        return forward(jnp.asarray([padded], jnp.int32))[0, len(sequence) - 1]

    tokens, new = list(prompt), []
    context = list(prompt)
    while len(new) < count:
        window: list[int] = []
        while len(new) < count and len(context) + len(window) <= model.max_len:
            logits = next_logits(context + window)
            window.append(int(jnp.argmax(logits)))
            new.append(window[-1])
            if window[-1] == _IdsTokenizer.eos_id:
                return new
        context = (tokens + new)[-(model.max_len // 2):]
    return new


def test_sampling_past_the_context_continues_on_a_sliding_window():
    from jdp.sample import Sampler

    model, params = _decoder(), _untrained_params()
    count = 3 * MAX_LEN  # three contexts' worth
    sampler = Sampler(model, params, _IdsTokenizer())
    text = sampler.continuation("3 1 4 1 5", max_new_tokens=count, temperature=0)
    expected = _window_by_window_greedy(model, params, [3, 1, 4, 1, 5], count)
    assert len(expected) == count  # never an eos: the whole window logic is exercised
    assert text == _IdsTokenizer().decode(expected)


# --- the Llama options (RMSNorm, SwiGLU, grouped-query attention, no biases) ---------------

LLAMA_OPTIONS = dict(norm="rmsnorm", mlp="swiglu", num_kv_heads=2, use_bias=False,
                     rotary_base=500_000.0)


@functools.cache
def _llama_variables() -> dict:
    model = _model(**LLAMA_OPTIONS)
    return jax.jit(lambda key: nn.unbox(model.init(key, _tokens(), train=False)))(
        jax.random.key(1, impl="rbg"))


def test_the_llama_options_keep_packed_documents_apart():
    model, variables, tokens = _model(**LLAMA_OPTIONS), _llama_variables(), _tokens()
    forward = jax.jit(lambda t: model.apply(variables, t, SEGMENT_IDS, POSITIONS, train=False))
    changed = tokens.at[:, :DOC1].set((tokens[:, :DOC1] + 1) % VOCAB_SIZE)
    np.testing.assert_allclose(forward(changed)[:, DOC1:], forward(tokens)[:, DOC1:], atol=1e-6)
    assert np.abs(forward(changed)[:, :DOC1] - forward(tokens)[:, :DOC1]).max() > 1e-3
    attention = variables["params"]["decoder_block_0"]["MultiHeadDotProductAttention_0"]
    assert attention["key"]["kernel"].shape == (32, 2, 8)  # 2 key/value heads of 4
    assert "bias" not in attention["query"] and "head" in variables["params"]


def test_the_llama_options_decode_with_a_cache_of_their_key_value_heads():
    model, variables, tokens = _model(**LLAMA_OPTIONS), _llama_variables(), _tokens(4)
    decoder = model.clone(decode=True)

    @jax.jit
    def cached_logits(tokens):
        cache = decoding.init_cache(model, 2, LENGTH)
        logits, state = decoder.apply({**variables, "cache": cache}, tokens[:, :9], train=False,
                                      mutable=["cache"])
        rest, state = decoder.apply({**variables, **state}, tokens[:, 9:], train=False,
                                    mutable=["cache"])
        return state["cache"], jnp.concatenate([logits, rest], axis=1)

    cache, logits = cached_logits(tokens)
    assert cache["decoder_block_0"]["MultiHeadDotProductAttention_0"]["cached_key"].shape == (
        2, LENGTH, 2, 8)
    full = jax.jit(lambda t: model.apply(variables, t, train=False))(tokens)
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


def test_the_llama_options_with_remat_give_the_same_gradients():
    variables, tokens = _llama_variables(), _tokens(5)

    def gradients(remat):
        model = _model(**LLAMA_OPTIONS, remat=remat)
        loss = lambda p: model.apply({"params": p}, tokens, train=False).mean()
        return jax.jit(jax.grad(loss))(variables["params"])

    for leaf, ref in zip(jax.tree.leaves(gradients("full")), jax.tree.leaves(gradients("none")),
                         strict=True):
        np.testing.assert_allclose(leaf, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fields, message", [
    (dict(num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(norm="batchnorm"), r"Unknown norm='batchnorm'"),
    (dict(mlp="relu"), r"Unknown mlp='relu'"),
])
def test_a_bad_llama_option_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError, match=message):
        _model(**fields)
