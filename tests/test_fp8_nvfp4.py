"""NVFP4's training recipe: the random Hadamard transform of the weight-gradient
products' operands, and weights quantized in 16 x 16 tiles.

Each property is checked where it is exact: operands chosen so that NVFP4 represents
them without error after the transform, and identity operands that read a quantized
weight back out of the forward and backward products.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy
from support.sharded_hlo import shared_run

R = jmp_policy.Float8Recipe


def test_nvfp4_defaults_and_settings_that_cannot_apply():
    recipe = R("nvfp4")
    assert not recipe.hadamard and not recipe.tiled_weights and not recipe.batched
    assert not recipe.four_over_six and R("nvfp4", four_over_six=True).four_over_six
    assert R("nvfp4", hadamard=True).hadamard and R("nvfp4", tiled_weights=True).tiled_weights
    for scaling in ("tensorwise", "rowwise", "mxfp8"):
        assert not R(scaling).hadamard and not R(scaling).tiled_weights
        for field in ("hadamard", "tiled_weights"):
            with pytest.raises(ValueError, match=f"{field} applies to scaling='nvfp4'"):
                R(scaling, **{field: True})
    with pytest.raises(TypeError, match="hadamard must be True or False"):
        R("nvfp4", hadamard=1)


def _weight_gradient(recipe, x, g):
    """The gradient of ``w`` in ``sum((x @ w) * g)`` under ``recipe``: ``x.T @ g`` quantized."""
    f = jmp_policy.autocast(lambda x, w: jnp.sum(x @ w * g), "float32", fp8=recipe)
    return jax.jit(jax.grad(f, argnums=1))(x, jnp.zeros((x.shape[1], g.shape[1])))


def _one_per_block(key, tokens, columns):
    """Values of magnitude 1, one per block of 16 tokens in each column, random signs:
    rotated, each block's values are all +-1/4, which NVFP4 holds exactly."""
    k1, k2 = jax.random.split(key)
    where = jax.random.randint(k1, (tokens // 16, columns), 0, 16)
    onehot = jax.nn.one_hot(where, 16, axis=1).reshape(tokens, columns)
    return onehot * jnp.where(jax.random.bernoulli(k2, shape=(tokens, columns)), 1.0, -1.0)


@pytest.mark.parametrize("hadamard", [True, False])
def test_rotated_weight_gradient_is_the_exact_product(hadamard):
    # Operands NVFP4 holds exactly before and after the rotation: the quantized weight
    # gradient is x.T @ g exactly if, and only if, both operands are rotated by the
    # same orthogonal matrix (one that is not orthogonal, or applied to one operand
    # only, changes the sums).
    x = _one_per_block(jax.random.key(0), 64, 32)
    g = _one_per_block(jax.random.key(1), 64, 48)
    got = _weight_gradient(R("nvfp4", hadamard=hadamard), x, g)  # tiled or not: x.T @ g
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x.T @ g))


def test_rotated_weight_gradient_is_applied_and_as_accurate_as_nvfp4():
    # Random operands: the rotation changes how they quantize (so it is applied), and
    # the result is the float32 product to NVFP4's precision (so it is the product).
    kx, kg = jax.random.split(jax.random.key(2))
    x, g = jax.random.normal(kx, (512, 64)), jax.random.normal(kg, (512, 48))
    want = np.asarray(x.T @ g)
    rotated = np.asarray(_weight_gradient(R("nvfp4", hadamard=True), x, g))
    plain = np.asarray(_weight_gradient(R("nvfp4"), x, g))
    assert not np.array_equal(rotated, plain)
    for got in (rotated, plain):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.25


def _forward_and_backward_weights(recipe, w, contract, x_shape):
    """The quantized ``w`` (``k`` values per output, ``k`` outputs) as the forward product
    and the backward product giving the left operand's gradient take it, read out with
    identity operands: ``(forward, backward, float32)``, each ``[*x_shape[1:], n]``."""
    k, n = x_shape[0], w.shape[-1]
    assert k == n == np.prod(x_shape[1:])
    x = jnp.eye(k).reshape(x_shape)
    f = jmp_policy.autocast(lambda x, w: jnp.einsum(contract, x, w), "float32", fp8=recipe)
    y, vjp = jax.vjp(jax.jit(f), x, w)
    grad_x = vjp(jnp.eye(n))[0]
    forward = np.asarray(y).reshape(*x_shape[1:], n)   # y[m]: w's values for input m
    backward = np.moveaxis(np.asarray(grad_x), 0, -1)  # grad_x[n]: w's values for output n
    exact = np.asarray(jnp.einsum(contract, x, w)).reshape(*x_shape[1:], n)
    return forward, backward, exact


@pytest.mark.parametrize("contract, x_shape, w_shape", [
    ("mk,kn->mn", (32, 32), (32, 32)),
    ("mab,abn->mn", (32, 2, 16), (2, 16, 32)),  # two contracting axes, in x's order
    ("mab,ban->mn", (32, 2, 16), (16, 2, 32)),  # two contracting axes, in another order
])
def test_tiled_weight_is_the_same_in_forward_and_backward_products(contract, x_shape, w_shape):
    scales = jnp.exp(jax.random.normal(jax.random.key(3), w_shape[:-1] + (1,)) * 2)
    w = jax.random.normal(jax.random.key(4), w_shape) * scales  # rows of varied magnitude
    forward, backward, exact = _forward_and_backward_weights(R("nvfp4", tiled_weights=True), w,
                                                             contract, x_shape)
    np.testing.assert_array_equal(forward, backward)
    assert np.linalg.norm(forward - exact) / np.linalg.norm(exact) < 0.2  # w, quantized
    # In blocks along one axis, the two products quantize w differently.
    forward, backward, _ = _forward_and_backward_weights(R("nvfp4"), w, contract, x_shape)
    assert not np.array_equal(forward, backward)


def test_tiled_expert_weights_are_the_same_in_forward_and_backward_products():
    experts, k, n = 2, 32, 32
    w = jax.random.normal(jax.random.key(5), (experts, k, n))
    w = w * jnp.exp(jax.random.normal(jax.random.key(6), (experts, k, 1)) * 2)
    sizes = jnp.array([k, k], jnp.int32)
    x = jnp.concatenate([jnp.eye(k)] * experts)  # each expert's rows: the identity

    def weights(recipe):
        f = jmp_policy.autocast(lambda x, w: jax.lax.ragged_dot(x, w, sizes), "float32",
                                fp8=recipe)
        y, vjp = jax.vjp(jax.jit(f), x, w)
        grad_x = vjp(jnp.concatenate([jnp.eye(n)] * experts))[0]
        forward = np.asarray(y).reshape(experts, k, n)
        backward = np.asarray(grad_x).reshape(experts, n, k).transpose(0, 2, 1)
        return forward, backward

    forward, backward = weights(R("nvfp4", tiled_weights=True))
    np.testing.assert_array_equal(forward, backward)
    assert np.linalg.norm(forward - w) / np.linalg.norm(w) < 0.2
    forward, backward = weights(R("nvfp4"))
    assert not np.array_equal(forward, backward)


def test_training_recipe_trains_a_linen_mlp():
    nn = pytest.importorskip("flax.linen")
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(nn.gelu(nn.Dense(64)(x)))

    model = MLP()
    x = jax.random.normal(jax.random.key(7), (64, 32))
    y = jnp.sin(x[:, :16])
    params = model.init(jax.random.key(8), x)
    loss = jmp_policy.autocast(
        lambda p: jnp.mean((model.apply(p, x) - y) ** 2), "mixed_bfloat16",
        fp8=R("nvfp4", hadamard=True, tiled_weights=True, exclude=()))
    tx = optax.adam(1e-2)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(60):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert np.isfinite(losses).all() and np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])


_SHARDED_SCRIPT = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jmp_policy

rng = np.random.RandomState(0)
x0 = rng.randn(256, 64).astype(np.float32)
x0[::16] *= 50  # an outlier token per block: the rotation's signs matter
g0 = rng.randn(256, 32).astype(np.float32)
f = jmp_policy.autocast(lambda x, w, g: jnp.sum(x @ w * g), "float32",
                       fp8=jmp_policy.Float8Recipe("nvfp4", hadamard=True))
grad = jax.jit(jax.grad(f, argnums=1))
w0 = np.zeros((64, 32), np.float32)
single = np.asarray(grad(x0, w0, g0))
facts = {}
for mode in ("explicit", "auto"):
    axis = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis,))
    with jax.set_mesh(mesh):
        x, g = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x0, g0))
        got = np.asarray(grad(x, w0, g))
    facts[mode] = float(np.linalg.norm(got - single) / np.linalg.norm(single))
json.dump(facts, open(sys.argv[1], "w"))
'''


@pytest.mark.slow  # a child interpreter on 8 simulated devices
def test_rotation_signs_do_not_depend_on_the_sharding(tmp_path_factory):
    # Tokens sharded across 8 devices, 32 per device: each device rotates its own
    # blocks. The weight gradient is the single device's up to float32 summation order;
    # signs drawn per shard (or per local block index) would change each block's
    # quantization, by about NVFP4's own error.
    script = tmp_path_factory.mktemp("nvfp4_sharded") / "sharded.py"
    script.write_text(_SHARDED_SCRIPT)
    facts = shared_run(tmp_path_factory, "nvfp4_sharded", [script])
    assert facts["explicit"] < 1e-5 and facts["auto"] < 1e-5, facts


def test_four_over_six_takes_the_better_scale_of_each_block():
    # x = I reads the quantized w out of the forward product: each block of 16 values
    # along w's contracting axis, per column, has no more squared error than with its
    # maximum mapped onto 6, and some have less (a value in the top third of a block).
    w = jax.random.normal(jax.random.key(9), (64, 32))
    x = jnp.eye(64)

    def blocks_error(recipe):
        f = jmp_policy.autocast(lambda x, w: x @ w, "float32", fp8=recipe)
        q = np.asarray(jax.jit(f)(x, w))
        return ((q - np.asarray(w)) ** 2).reshape(4, 16, 32).sum(axis=1)

    six, adaptive = blocks_error(R("nvfp4")), blocks_error(R("nvfp4", four_over_six=True))
    assert (adaptive <= six * (1 + 1e-6)).all()
    assert (adaptive < 0.9 * six).mean() > 0.2
    with pytest.raises(ValueError, match="four_over_six applies to scaling='nvfp4'"):
        R("mxfp8", four_over_six=True)


def test_four_over_six_leaves_stochastically_rounded_gradients_unbiased():
    # The incoming gradient keeps its scale to 6 and its stochastic rounding: the weight
    # gradient of a constant-ish cotangent stays unbiased (as without four_over_six).
    x, w = jnp.ones((2048, 32)), jax.random.normal(jax.random.key(10), (32, 16))
    ct = jnp.full((2048, 16), 2.5).at[::16].set(6.0)
    f = jmp_policy.autocast(jnp.matmul, "float32", fp8=R("nvfp4", four_over_six=True))
    _, grad_w = jax.jit(lambda x, w, ct: jax.vjp(f, x, w)[1](ct))(x, w, ct)
    want = x.T @ ct
    assert np.linalg.norm(grad_w - want) / np.linalg.norm(want) < 0.02
