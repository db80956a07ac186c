"""The language-model parts: the causal Transformer and the built-in addition task."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.data import addition
from jdp.models.transformer import (
    TRANSFORMER_SIZES,
    Transformer,
    apply_rotary,
    flops_per_token,
    transformer,
)
from runs import USERS_FUSION

VOCAB_SIZE = 14
MAX_LEN = 16
LENGTH = 10  # shorter than MAX_LEN on purpose
SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64)


def _model(**kwargs) -> Transformer:
    return Transformer(**{"vocab_size": VOCAB_SIZE, "max_len": MAX_LEN, **SMALL, **kwargs})


def _tokens(length: int = LENGTH) -> jnp.ndarray:
    """A batch of two random token sequences."""
    return jax.random.randint(jax.random.key(0), (2, length), 0, VOCAB_SIZE)


# Compiling dominates these tests: each model is compiled once (running eagerly compiles
# every op instead).


@functools.cache
def _variables(positions: str) -> dict:
    """Initial variables of the small model; they depend on neither dtype, remat nor dropout."""
    model = _model(positions=positions)
    # The 'rbg' generator compiles much faster on XLA:CPU than threefry.
    init = jax.jit(lambda key: nn.unbox(model.init(key, _tokens(), train=False)))
    return init(jax.random.key(1, impl="rbg"))


@functools.cache
def _forward(model: Transformer):
    """`model`'s compiled forward pass: (variables, tokens, dropout key) -> logits."""
    return jax.jit(lambda variables, tokens, train, dropout_key: model.apply(
        variables, tokens, train=train, rngs={"dropout": dropout_key}), static_argnums=2)


def _logits(model: Transformer, variables: dict, tokens: jnp.ndarray, train: bool = False,
            dropout_key: jax.Array | None = None) -> jax.Array:
    dropout_key = jax.random.key(0) if dropout_key is None else dropout_key
    return _forward(model)(variables, tokens, train, dropout_key)


# --- the Transformer ---------------------------------------------------------


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_changing_a_later_token_changes_its_own_logits_but_no_earlier_ones(positions):
    model = _model(positions=positions)
    tokens = _tokens()
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % VOCAB_SIZE)
    before = _logits(model, _variables(positions), tokens)
    after = _logits(model, _variables(positions), changed)
    np.testing.assert_allclose(after[:, :6], before[:, :6], atol=1e-6)
    assert np.abs(after[:, 6] - before[:, 6]).min(axis=-1).max() > 1e-4
    assert (np.abs(after[:, 7:] - before[:, 7:]).max(axis=-1) > 1e-4).all()


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_logits_are_float32_batch_by_length_by_vocab(positions):
    logits = _logits(_model(positions=positions), _variables(positions), _tokens())
    assert logits.shape == (2, LENGTH, VOCAB_SIZE)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_bfloat16_with_remat_gives_float32_logits_close_to_float32_compute(positions):
    variables, tokens = _variables(positions), _tokens()
    model = _model(positions=positions, dtype=jnp.bfloat16, remat="full")
    logits = _logits(model, variables, tokens)
    assert logits.dtype == jnp.float32
    reference = _logits(_model(positions=positions), variables, tokens)
    # bf16 keeps 8 bits of mantissa: logits of size ~1 agree to a few hundredths.
    np.testing.assert_allclose(logits, reference, atol=0.1)
    assert np.abs(logits - reference).max() > 0  # the compute did run in bf16


def test_only_learned_positions_add_a_position_embedding_of_max_len():
    learned, rotary = _variables("learned")["params"], _variables("rotary")["params"]
    assert learned["position_embedding"].shape == (MAX_LEN, SMALL["hidden_size"])
    assert "position_embedding" not in rotary


def test_remat_full_keeps_logits_and_gradients():
    tokens, params = _tokens(), _variables("rotary")["params"]
    weights = jax.random.normal(jax.random.key(3), (2, LENGTH, VOCAB_SIZE))

    def logits_and_grads(remat: str):
        model = _model(remat=remat)
        logits = lambda p: model.apply({"params": p}, tokens, train=True)
        loss = lambda p: (logits(p) * weights).sum()
        # Users' fusion emitters: the two programs are fused differently (runs.USERS_FUSION).
        return jax.jit(lambda p: (logits(p), jax.grad(loss)(p)),
                       compiler_options=USERS_FUSION)(params)

    expected, actual = logits_and_grads("none"), logits_and_grads("full")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 actual, expected)


def test_dropout_acts_in_training_only():
    model, variables, tokens = _model(dropout_rate=0.5), _variables("rotary"), _tokens()
    no_dropout = _logits(_model(), variables, tokens)
    np.testing.assert_array_equal(_logits(model, variables, tokens), no_dropout)
    trained = _logits(model, variables, tokens, train=True, dropout_key=jax.random.key(4))
    assert np.abs(trained - no_dropout).max() > 1e-3


def test_rotary_scores_depend_only_on_the_offset_between_positions():
    head_dim, length = 8, 6
    query = jnp.broadcast_to(jax.random.normal(jax.random.key(5), (head_dim,)),
                             (length, 1, head_dim))
    key = jnp.broadcast_to(jax.random.normal(jax.random.key(6), (head_dim,)),
                           (length, 1, head_dim))
    positions = jnp.arange(length)
    scores = jnp.einsum("qhd,khd->qk", apply_rotary(query, positions), apply_rotary(key, positions))
    for offset in range(-length + 1, length):
        diagonal = np.diagonal(scores, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-5, atol=1e-5)
    assert abs(scores[1, 0] - scores[0, 0]) > 1e-3  # the rotation does depend on the offset
    np.testing.assert_allclose(np.linalg.norm(apply_rotary(query, positions), axis=-1),
                               np.linalg.norm(query, axis=-1), rtol=1e-5)


def test_sequences_longer_than_max_len_name_both_lengths():
    with pytest.raises(ValueError, match=r"Sequence length \(17\) exceeds max_len \(16\)"):
        _logits(_model(), _variables("rotary"), _tokens(length=MAX_LEN + 1))


def test_unknown_positions_names_the_field_and_valid_values():
    with pytest.raises(ValueError, match=r"positions='absolute'.*rotary, learned"):
        _model(positions="absolute")


def test_unknown_remat_names_the_field_and_valid_names():
    with pytest.raises(ValueError, match=r"remat='most'.*none, full, dots_saveable"):
        _model(remat="most")


def test_hidden_size_not_divisible_by_num_heads_names_both():
    with pytest.raises(ValueError, match=r"hidden_size \(30\).*num_heads \(4\)"):
        _model(hidden_size=30)


def test_rotary_needs_an_even_head_dim_and_learned_does_not():
    with pytest.raises(ValueError, match=re.escape("12 / 4 = 3")):
        _model(hidden_size=12, positions="rotary")
    _model(hidden_size=12, positions="learned")


def test_named_sizes_set_the_shape_and_kwargs_override_them():
    model = transformer("nano", vocab_size=VOCAB_SIZE, max_len=MAX_LEN, num_layers=1)
    assert (model.hidden_size, model.num_heads, model.mlp_dim) == (64, 4, 256)
    assert model.num_layers == 1 and model.max_len == MAX_LEN
    assert set(TRANSFORMER_SIZES) >= {"nano", "tiny", "small", "base"}
    with pytest.raises(ValueError, match=r"model\.size='huge'.*nano, tiny, small, base"):
        transformer("huge", vocab_size=VOCAB_SIZE, max_len=MAX_LEN)


def test_flops_per_token_is_six_per_matmul_weight_plus_attention():
    kernels = jax.tree_util.tree_flatten_with_path(_variables("learned")["params"])[0]
    matmul_params = sum(leaf.size for path, leaf in kernels if path[-1].key == "kernel")
    hidden, layers = SMALL["hidden_size"], SMALL["num_layers"]
    expected = 6 * matmul_params + 12 * layers * hidden * LENGTH
    assert flops_per_token(hidden_size=hidden, num_layers=layers, mlp_dim=SMALL["mlp_dim"],
                           vocab_size=VOCAB_SIZE, length=LENGTH) == expected


# --- the addition task -------------------------------------------------------

NUM_EXAMPLES = 200


def _parse(text: str) -> tuple[str, str, str]:
    """The operands and the answer, as written, of an example's decoded tokens."""
    match = re.fullmatch(r"(\d+)\+(\d+)=(\d+)\$_*", text)
    assert match, text
    return match[1], match[2], match[3]


def test_a_hand_made_example_has_the_reversed_sum_and_weights_on_answer_and_eos():
    example = addition.make_example(347, 85, max_digits=3)
    assert addition.problem_text(347, 85) == "347+85=234"
    assert addition.decode(example["inputs"]) == "347+85=234$_"
    assert addition.decode(example["targets"]) == "47+85=234$__"
    np.testing.assert_array_equal(example["weights"], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0])


def test_every_answer_is_the_sum_reversed_with_no_leading_zero_operands():
    source = addition.AdditionSource(NUM_EXAMPLES, seed=0, max_digits=3)
    digit_counts = set()
    for index in range(NUM_EXAMPLES):
        example = source[index]
        tokens = np.concatenate([example["inputs"][:1], example["targets"]])
        a, b, answer = _parse(addition.decode(tokens))
        assert answer[::-1] == str(int(a) + int(b))
        assert a == str(int(a)) and b == str(int(b))  # no leading zeros
        digit_counts |= {len(a), len(b)}
    assert digit_counts == {1, 2, 3}


def test_weights_are_one_exactly_on_answer_and_eos_targets():
    source = addition.AdditionSource(NUM_EXAMPLES, seed=0, max_digits=3)
    for index in range(NUM_EXAMPLES):
        example = source[index]
        text = addition.decode(example["targets"])
        answer_and_eos = [i > text.index("=") and i <= text.index("$") for i in range(len(text))]
        np.testing.assert_array_equal(example["weights"], np.array(answer_and_eos, np.float32))


def test_targets_are_the_inputs_shifted_by_one():
    example = addition.AdditionSource(10, seed=0)[3]
    np.testing.assert_array_equal(example["inputs"][1:], example["targets"][:-1])


def test_all_examples_have_one_shape_and_dtype():
    source = addition.AdditionSource(NUM_EXAMPLES, seed=0, max_digits=3)
    length = addition.sequence_length(3)
    assert length == source.sequence_length == 12
    for index in range(NUM_EXAMPLES):
        example = source[index]
        assert {k: (v.shape, v.dtype) for k, v in example.items()} == {
            "inputs": ((length,), np.int32),
            "targets": ((length,), np.int32),
            "weights": ((length,), np.float32),
        }
    # The longest problem fills the length exactly: its targets end with EOS.
    assert addition.decode(addition.make_example(999, 999, max_digits=3)["targets"]) == (
        "99+999=8991$")


def test_an_example_is_a_pure_function_of_seed_and_index():
    first, second = addition.AdditionSource(50, seed=7), addition.AdditionSource(50, seed=7)
    for index in [3, 0, 49, 3]:  # any order of reads
        for key, value in first[index].items():
            np.testing.assert_array_equal(second[index][key], value)
    other_seed = addition.AdditionSource(50, seed=8)
    assert any((first[i]["inputs"] != other_seed[i]["inputs"]).any() for i in range(50))


def test_train_and_eval_sources_have_their_sizes_and_differ():
    train, eval_ = addition.sources(seed=0, max_digits=3, num_train=100, num_eval=20)
    assert (len(train), len(eval_)) == (100, 20)
    assert eval_.seed != train.seed
    assert any((train[i]["inputs"] != eval_[i]["inputs"]).any() for i in range(20))


def test_index_out_of_range_raises_index_error():
    source = addition.AdditionSource(5, seed=0)
    with pytest.raises(IndexError):
        source[5]


def test_encode_and_decode_are_inverse_and_encode_rejects_other_characters():
    assert addition.encode("12+9=12") == [1, 2, 10, 9, 11, 1, 2]
    assert addition.decode(addition.encode("0123456789+=_$")) == "0123456789+=_$"
    assert addition.decode([addition.PAD, addition.EOS]) == "_$"
    assert addition.VOCAB_SIZE == 14
    with pytest.raises(ValueError, match=r"\['-'\]"):
        addition.encode("3-1=2")
