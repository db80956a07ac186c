"""The models in jdp.models: shapes and dtypes, errors, remat and global-batch BatchNorm."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp import DATA_AXIS
from jdp.dryrun.lowering import compile_to_read
from jdp.models import REMAT_POLICIES, ResNet, ViT, remat_policy, resnet, vit
from jdp.parallel import compiler_options
from jdp.parallel.mesh import make_mesh
from runs import USERS_FUSION

NUM_CLASSES = 10
DIGITS_IMAGES = jnp.ones((4, 8, 8, 1))
DIGITS_LABELS = jnp.arange(4) % NUM_CLASSES


def _nano_vit(**kwargs) -> ViT:
    return vit("nano", num_classes=NUM_CLASSES, patch_size=2, **kwargs)


def _tiny_resnet(**kwargs) -> ResNet:
    return resnet("tiny", num_classes=NUM_CLASSES, small_inputs=True, **kwargs)


def _variables(model: nn.Module, images: jax.Array) -> dict:
    """Initial variables of `model`; they depend on neither dtype, remat nor dropout."""
    neutral = {"dtype": jnp.float32, "remat": "none", "dropout_rate": 0.0}
    model = model.clone(**{k: v for k, v in neutral.items() if hasattr(model, k)})
    return _init_once(model, images.shape[1:])


@functools.cache
def _init_once(model: nn.Module, image_shape: tuple[int, ...]) -> dict:
    # Initialise once per model, with the 'rbg' generator, which XLA:CPU compiles
    # much faster than threefry.
    init = jax.jit(lambda key: nn.unbox(model.init(key, jnp.ones((1, *image_shape)),
                                                   train=False)))
    return init(jax.random.key(0, impl="rbg"))


def _abstract_variables(model: nn.Module, images: jax.Array) -> dict:
    """The shapes and dtypes of `model`'s initial variables, without compiling."""
    return jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), images, train=False)))


def _abstract_logits(model: nn.Module, images: jax.Array) -> jax.ShapeDtypeStruct:
    """The shape and dtype of a training forward pass's logits, without compiling."""
    variables = _abstract_variables(model, images)
    return jax.eval_shape(
        lambda v: model.apply(v, images, train=True, mutable=["batch_stats"])[0], variables
    )


def _loss_fn(model, params, other_variables, images, labels, dropout_key):
    """Mean cross-entropy of a training forward pass, and the updated batch_stats."""
    logits, updates = model.apply(
        {"params": params, **other_variables},
        images,
        train=True,
        rngs={"dropout": dropout_key},
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates.get("batch_stats")


def _loss_stats_and_grads(model, variables, images, labels):
    """((loss, new batch_stats), gradients) of one training step, compiled with users'
    fusion emitters: the remat tests compare it with a differently fused program."""
    params = variables["params"]
    other_variables = {k: v for k, v in variables.items() if k != "params"}
    grad_fn = jax.value_and_grad(functools.partial(_loss_fn, model), has_aux=True)
    return jax.jit(grad_fn, compiler_options=USERS_FUSION)(params, other_variables, images,
                                                         labels, jax.random.key(2))


def _assert_trees_close(actual, expected) -> None:
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6), actual, expected
    )


# --- shapes and dtypes -------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_vit_returns_float32_logits_per_example(pool, dtype):
    logits = _abstract_logits(_nano_vit(pool=pool, dtype=dtype), DIGITS_IMAGES)
    assert (logits.shape, logits.dtype) == ((4, NUM_CLASSES), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "small_inputs,image_size", [(True, 8), (False, 32)], ids=["small_stem", "imagenet_stem"]
)
def test_resnet_returns_float32_logits_per_example(small_inputs, image_size, dtype):
    model = resnet("tiny", num_classes=NUM_CLASSES, small_inputs=small_inputs, dtype=dtype)
    logits = _abstract_logits(model, jnp.ones((4, image_size, image_size, 3)))
    assert (logits.shape, logits.dtype) == ((4, NUM_CLASSES), jnp.float32)


def test_vit_bf16_logits_match_float32_logits_to_bf16_precision():
    images = jax.random.normal(jax.random.key(1), DIGITS_IMAGES.shape)
    variables = _variables(_nano_vit(), images)

    def logits(dtype):
        model = _nano_vit(dtype=dtype)
        return jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, images)

    # bf16 keeps 8 bits of mantissa: a few parts in a hundred after a few layers.
    np.testing.assert_allclose(logits(jnp.bfloat16), logits(jnp.float32), rtol=0.05, atol=0.05)


def test_vit_cls_pool_learns_a_class_token_and_gap_does_not():
    cls_params = _abstract_variables(_nano_vit(pool="cls"), DIGITS_IMAGES)["params"]
    gap_params = _abstract_variables(_nano_vit(pool="gap"), DIGITS_IMAGES)["params"]
    # 8x8 images in 2x2 patches: 16 patch tokens, plus the class token.
    assert cls_params["position_embedding"].shape == (1, 17, 64)
    assert gap_params["position_embedding"].shape == (1, 16, 64)
    assert "cls_token" in cls_params and "cls_token" not in gap_params


@pytest.mark.parametrize("build", [_nano_vit, _tiny_resnet], ids=["vit", "resnet"])
def test_bf16_compute_keeps_variables_float32(build):
    model = build(dtype=jnp.bfloat16)
    variables = _abstract_variables(model, DIGITS_IMAGES)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("build", [_nano_vit, _tiny_resnet], ids=["vit", "resnet"])
def test_bf16_compute_runs_every_matmul_and_conv_in_bf16(build):
    model = build(dtype=jnp.bfloat16)
    variables = _abstract_variables(model, DIGITS_IMAGES)
    jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(
        variables, DIGITS_IMAGES
    )
    # Each equation prints as `name:dtype[shape] = primitive[...]`.
    result_dtypes = re.findall(
        r":(\w+)\[[\d,]*\] = (?:dot_general|conv_general_dilated)\[", str(jaxpr)
    )
    assert result_dtypes and set(result_dtypes) == {"bf16"}


# --- errors name the field ---------------------------------------------------


def test_unknown_vit_size_names_the_field_and_valid_sizes():
    with pytest.raises(ValueError, match=r"model\.size='huge'.*nano, tiny, small, base, large"):
        vit("huge", num_classes=NUM_CLASSES, patch_size=16)


def test_unknown_resnet_size_names_the_field_and_valid_sizes():
    with pytest.raises(ValueError, match=r"model\.size='101'.*tiny, 18, 34, 50"):
        resnet("101", num_classes=NUM_CLASSES)


def test_image_size_not_divisible_by_patch_size_names_both():
    model = vit("nano", num_classes=NUM_CLASSES, patch_size=3)
    with pytest.raises(ValueError, match=r"8x8 .*patch_size \(3\)"):
        _abstract_variables(model, DIGITS_IMAGES)


@pytest.mark.parametrize(
    "build",
    [
        lambda: remat_policy("most"),
        lambda: _nano_vit(remat="most"),
        lambda: _tiny_resnet(remat="most"),
    ],
    ids=["remat_policy", "vit", "resnet"],
)
def test_unknown_remat_names_the_field_and_valid_names(build):
    with pytest.raises(ValueError, match=r"remat='most'.*none, full, dots_saveable"):
        build()


def test_unknown_vit_pool_names_the_field():
    with pytest.raises(ValueError, match=r"pool='max'.*cls, gap"):
        _nano_vit(pool="max")


# --- remat -------------------------------------------------------------------


def test_remat_names_map_to_jax_checkpoint_policies():
    assert remat_policy("none") is None
    # jax.checkpoint treats nothing_saveable as policy=None: save nothing, recompute all.
    assert remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    assert remat_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
    assert REMAT_POLICIES[0] == "none" and len(set(REMAT_POLICIES)) == len(REMAT_POLICIES)


@pytest.mark.parametrize(
    "build,policies",
    [
        # Dropout checks that the recomputed forward pass draws the same masks.
        (functools.partial(_nano_vit, dropout_rate=0.1), ("full", "dots_saveable")),
        # BatchNorm checks that batch_stats updates come out of the remat'd blocks.
        (_tiny_resnet, ("full",)),
    ],
    ids=["vit_with_dropout", "resnet"],
)
def test_remat_keeps_loss_batch_stats_and_gradients(build, policies):
    images = jax.random.normal(jax.random.key(1), DIGITS_IMAGES.shape)
    variables = _variables(build(), images)
    expected = _loss_stats_and_grads(build(), variables, images, DIGITS_LABELS)
    for remat in policies:
        actual = _loss_stats_and_grads(build(remat=remat), variables, images, DIGITS_LABELS)
        _assert_trees_close(actual, expected)


def test_remat_lowers_compiled_temp_memory_of_a_vit_train_step():
    images = jnp.ones((8, 32, 32, 3))
    labels = jnp.zeros((8,), jnp.int32)

    def temp_bytes(remat: str) -> int:
        model = vit("nano", num_classes=NUM_CLASSES, patch_size=4, remat=remat)
        params = _abstract_variables(model, images)["params"]
        grad_fn = jax.grad(lambda p: _loss_fn(model, p, {}, images, labels, jax.random.key(0))[0])
        # Under the XLA:CPU schedule jdp picks for remat (compiler_options says why).
        compiled = compile_to_read(jax.jit(grad_fn).lower(params),
                                   compiler_options("cpu", "full"))
        return compiled.memory_analysis().temp_size_in_bytes

    # Measured: 6.97 MB without remat, 4.82 MB with 'full' (6.04 MB with 'dots_saveable')
    # on jax 0.10.2; 6.82, 3.70 (5.05) on 0.12.1.
    none, full = temp_bytes("none"), temp_bytes("full")
    assert full <= 0.9 * none, (none, full)


# --- BatchNorm ---------------------------------------------------------------


def test_resnet_batchnorm_over_data_axis_matches_the_whole_batch_on_one_device():
    num_devices = jax.local_device_count()
    per_device_batch_size = 2
    global_batch_size = num_devices * per_device_batch_size
    # Shift each device's rows by a different amount so that per-device statistics
    # differ from the global ones: without the cross-device reduction this test fails.
    device_index = jnp.arange(global_batch_size) // per_device_batch_size
    images = jax.random.normal(jax.random.key(1), (global_batch_size, 8, 8, 1))
    images = images + device_index[:, None, None, None]
    labels = jnp.arange(global_batch_size) % NUM_CLASSES
    variables = _variables(_tiny_resnet(), images)
    expected = _loss_stats_and_grads(_tiny_resnet(), variables, images, labels)

    def device_step(images, labels):
        model = _tiny_resnet(bn_axis_name=DATA_AXIS)
        grad_fn = jax.value_and_grad(functools.partial(_loss_fn, model), has_aux=True)
        stats = {"batch_stats": variables["batch_stats"]}
        (loss, new_stats), grads = grad_fn(
            variables["params"], stats, images, labels, jax.random.key(2)
        )
        return (jax.lax.pmean(loss, DATA_AXIS), new_stats), jax.lax.pmean(grads, DATA_AXIS)

    # Bound as jdp binds jdp.DATA_AXIS: shard_map over the (hosts, local) mesh, here
    # 2 hosts of 4 devices, so the statistics must span both mesh axes.
    mesh = make_mesh(devices=jax.local_devices(), hosts=2)
    step = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=jax.P(DATA_AXIS),
                                 out_specs=jax.P(), check_vma=False))
    _assert_trees_close(step(images, labels), expected)


def test_resnet_eval_uses_running_statistics_so_padding_rows_change_nothing():
    model = _tiny_resnet()
    images = jax.random.normal(jax.random.key(1), DIGITS_IMAGES.shape)
    variables = _variables(model, images)
    # Evaluation pads the last batch: the padding must not change the real rows' logits.
    padded = jnp.concatenate([images, 100.0 * jnp.ones_like(images)])
    apply = jax.jit(functools.partial(model.apply, train=False))
    logits, padded_logits = apply(variables, images), apply(variables, padded)
    np.testing.assert_allclose(padded_logits[:4], logits, rtol=1e-6, atol=1e-6)
