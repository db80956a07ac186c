"""Autoregressive sampling from the causal Transformer with a key/value cache.

Owns `generate` (prompt in, new token ids out) and `init_cache`. The model runs with
`decode=True`, the same params plus a 'cache' collection of every layer's keys and values
(see transformer.CausalSelfAttention). All but the prompt's last token go through it in
one pass (prefill); then each step feeds one token (the prompt's last, then the one just
sampled) and samples the next. All of it is one jitted program over a cache of fixed
size, prompt length + max_new_tokens - 1: a lax.while_loop whose state is the cache, the
tokens so far and which sequences have ended, and which stops once all of them have
produced `eos_id`. The sampling settings are arguments of that program, not constants
of it, so changing them does not compile again.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.models.transformer import Transformer


def init_cache(model: Transformer, batch_size: int, length: int) -> dict[str, Any]:
    """The empty (zero) 'cache' collection of `model` in decode mode for `length` tokens."""
    decoder = model.clone(decode=True)
    tokens = jnp.zeros((batch_size, length), jnp.int32)
    # Only the shapes: eval_shape runs no init of the params it also describes.
    shapes = jax.eval_shape(
        lambda: decoder.init(jax.random.key(0), tokens, train=False)["cache"]
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _sample(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array
) -> jax.Array:
    """One token per row of float32 `logits` [batch, vocab]; 0 temperature is greedy.

    Ties at the k-th largest logit keep all of the tied tokens.
    """
    greedy = jnp.argmax(logits, axis=-1)
    logits = logits / jnp.where(temperature > 0, temperature, 1.0)

    def keep_top_k(logits: jax.Array) -> jax.Array:
        kth_largest = jnp.sort(logits, axis=-1)[:, logits.shape[-1] - top_k]
        return jnp.where(logits < kth_largest[:, None], -jnp.inf, logits)

    # The sort only where top_k asks for it.
    logits = jax.lax.cond(top_k > 0, keep_top_k, lambda logits: logits, logits)
    sampled = jax.random.categorical(key, logits, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.cache
def _generate_fn(decoder: Transformer, max_new_tokens: int) -> Callable[..., jax.Array]:
    """The jitted (params, prompt [batch, length], key, temperature, top_k, eos_id) -> new
    tokens [batch, max_new_tokens]; eos_id -1 is none.

    Cached by its static arguments (Linen modules hash by their fields), so a second
    `generate` with the same model and number of tokens reuses the compiled program.
    """

    def forward(params, tokens, cache):
        logits, variables = decoder.apply(
            {"params": params, "cache": cache}, tokens, train=False, mutable=["cache"]
        )
        return logits[:, -1], variables["cache"]

    @jax.jit
    def run(params, prompt, key, temperature, top_k, eos_id):
        batch_size, prompt_len = prompt.shape
        # The last token sampled is never fed back, so it needs no cache entry.
        cache = init_cache(decoder, batch_size, prompt_len + max_new_tokens - 1)
        # Prefill: all but the prompt's last token in one pass. Step i feeds the last token
        # (the prompt's, then the one sampled at step i - 1) and samples new token i.
        if prompt_len > 1:
            _, cache = forward(params, prompt[:, :-1], cache)

        def unfinished(state):
            i, _, _, _, done = state
            return (i < max_new_tokens) & ~done.all()

        def step(state):
            i, token, new_tokens, cache, done = state
            logits, cache = forward(params, token[:, None], cache)
            token = _sample(logits, jax.random.fold_in(key, i), temperature, top_k)
            # A sequence that has ended repeats eos_id.
            token = jnp.where(done, eos_id, token)
            new_tokens = new_tokens.at[:, i].set(token)
            return i + 1, token, new_tokens, cache, done | (token == eos_id)

        # Slots never written (all sequences ended early) read eos_id.
        new_tokens = jnp.full((batch_size, max_new_tokens), eos_id, jnp.int32)
        state = (0, prompt[:, -1], new_tokens, cache, jnp.zeros(batch_size, jnp.bool_))
        return jax.lax.while_loop(unfinished, step, state)[2]

    return run


def generate(
    model: Transformer,
    params: Any,
    prompt: np.ndarray | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    key: jax.Array | None = None,
    eos_id: int | None = None,
) -> np.ndarray:
    """Sample `max_new_tokens` tokens that continue `prompt`; returns the new token ids.

    `params` is the model's 'params' collection (trained with or without `decode`).
    `prompt` is one sequence [length] or a batch of equally long ones [batch, length].
    `temperature` 0 takes the most likely token (greedy); otherwise tokens are drawn from
    softmax(logits / temperature), restricted to the `top_k` most likely when top_k > 0.
    The same `seed` (or random `key`, which replaces it) gives the same tokens. Once a
    sequence samples `eos_id` it stops: for
    one prompt the result ends with that eos, for a batch the rest of its row is eos_id.
    The prompt and new tokens must fit in the model: prompt length + max_new_tokens - 1
    <= max_len (the last token sampled is never fed back).
    """
    tokens = np.asarray(prompt)
    if tokens.ndim not in (1, 2) or tokens.shape[-1] == 0:
        raise ValueError(
            f"prompt has shape {tokens.shape}; pass a non-empty sequence of token ids "
            f"[length] or a batch of equally long ones [batch, length]"
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"prompt has dtype {tokens.dtype}; pass integer token ids")
    if tokens.min() < 0 or tokens.max() >= model.vocab_size:
        raise ValueError(
            f"prompt has token ids outside [0, vocab_size={model.vocab_size}); "
            f"pass ids the model's vocabulary has"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; ask for at least one token")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}; set it >= 0 (0 is greedy)")
    if not 0 <= top_k <= model.vocab_size:
        raise ValueError(
            f"top_k={top_k}; set it between 0 (no limit) and vocab_size ({model.vocab_size})"
        )
    if eos_id is not None and not 0 <= eos_id < model.vocab_size:
        raise ValueError(
            f"eos_id={eos_id} is no token id; set it in [0, vocab_size={model.vocab_size}) "
            f"or to None"
        )
    if "params" in params and "token_embedding" not in params:
        raise ValueError("params is a variables dict; pass its 'params' collection")
    batched = tokens.ndim == 2
    tokens = tokens if batched else tokens[None]
    needed = tokens.shape[1] + max_new_tokens - 1
    if needed > model.max_len:
        raise ValueError(
            f"prompt length ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) - 1 = "
            f"{needed} exceeds max_len ({model.max_len}); shorten the prompt, lower "
            f"`max_new_tokens` or raise `max_len`"
        )
    run = _generate_fn(model.clone(decode=True), max_new_tokens)
    new_tokens = np.asarray(run(
        params, jnp.asarray(tokens, jnp.int32), jax.random.key(seed) if key is None else key,
        jnp.float32(temperature), jnp.int32(top_k), jnp.int32(-1 if eos_id is None else eos_id),
    ))
    if batched:
        return new_tokens
    new_tokens = new_tokens[0]
    if eos_id is not None and (new_tokens == eos_id).any():
        new_tokens = new_tokens[: int(np.argmax(new_tokens == eos_id)) + 1]
    return new_tokens
