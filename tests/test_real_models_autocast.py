"""Autocast on real models (tests/real_models.py): linen, NNX and Equinox, as users write them.

For every model of the zoo, under ``jit`` and with dropout and padding on:
``autocast`` in ``mixed_bfloat16`` and ``mixed_float16`` gives the float32
loss and gradients to a half-precision tolerance, float8 (tensorwise and
rowwise) gives finite gradients and a close loss, a few loss-scaled float16
train steps skip no step, and no warning is raised. The float32 loss of each
model is computed once (a module-scoped cache).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
import jmp_policy.flax  # noqa: F401  (the NNX train step)

rm = pytest.importorskip("real_models")  # skips with flax or equinox missing
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

pytestmark = pytest.mark.filterwarnings("error")  # no AutocastWarning, no unmatched rule

NAMES = sorted(rm.MODELS)
FRAMEWORK_JIT = {"linen": functools.partial(jax.jit, static_argnums=4),
                 "nnx": functools.partial(nnx.jit, static_argnums=2),
                 "equinox": eqx.filter_jit}


def evaluate(model, loss_fn, seed=0):
    """Jitted ``((loss, aux), grads)`` of ``loss_fn`` on the model's batch, train mode."""
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(seed), 3)
    state, batch = model.init(k_init), model.batch(k_batch)
    g = FRAMEWORK_JIT[model.framework](model.value_and_grad(loss_fn))
    if model.framework == "linen":
        params = state["params"]
        rest = {k: v for k, v in state.items() if k != "params"}
        return g(params, rest, batch, k_drop, True)
    if model.framework == "nnx":
        return g(state, batch, True)  # dropout from the module's own Rngs, same seed each time
    return g(state, batch, k_drop, True)


@functools.cache
def float32_run(name):
    return evaluate(rm.MODELS[name], rm.MODELS[name].loss)


def float_leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)
            if x is not None and jnp.issubdtype(x.dtype, jnp.floating)]


def relative_error(got, want):
    got, want = float_leaves(got), float_leaves(want)
    assert len(got) == len(want)
    num = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got, want)))
    return num / np.sqrt(sum(np.sum(b ** 2) for b in want))


@pytest.mark.parametrize("policy,tol", [("mixed_bfloat16", 3e-2), ("mixed_float16", 1e-2)])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision_loss_and_gradients_match_float32(name, policy, tol):
    model = rm.MODELS[name]
    (loss, aux), grads = evaluate(model, jmp_policy.autocast(model.loss, policy))
    (want, want_aux), want_grads = float32_run(name)
    assert loss.dtype == jnp.float32  # a loss is never narrowed: float32 class
    assert abs(float(loss) - float(want)) <= tol * abs(float(want))
    assert relative_error(grads, want_grads) <= 5 * tol
    for got, ref in zip(jax.tree.leaves(aux), jax.tree.leaves(want_aux)):
        assert got.dtype == ref.dtype  # BatchNorm statistics stay float32


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name", NAMES)
def test_float8_gradients_are_finite_with_padding_and_dropout(name, scaling):
    model = rm.MODELS[name]
    if name in ("linen_resnet",):  # convolutions only: autocast says fp8 changes nothing
        with pytest.warns(jmp_policy.AutocastWarning, match="none of its matrix products"):
            jmp_policy.autocast(model.loss, "mixed_bfloat16", fp8=scaling)(
                *_eager_args(model))
        return
    (loss, _), grads = evaluate(model, jmp_policy.autocast(model.loss, "mixed_bfloat16",
                                                           fp8=scaling))
    (want, _), want_grads = float32_run(name)
    assert all(np.isfinite(g).all() for g in float_leaves(grads))
    assert abs(float(loss) - float(want)) <= 0.05 * abs(float(want))
    assert relative_error(grads, want_grads) <= 0.3


def _eager_args(model):
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(0), 3)
    state, batch = model.init(k_init), model.batch(k_batch)
    if model.framework == "linen":
        rest = {k: v for k, v in state.items() if k != "params"}
        return state["params"], rest, batch, k_drop, True
    return (state, batch, True) if model.framework == "nnx" else (state, batch, k_drop, True)


@pytest.mark.parametrize("name", NAMES)
def test_loss_scaled_float16_steps_skip_nothing(name):
    model = rm.MODELS[name]
    loss_fn = jmp_policy.autocast(model.loss, "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "mixed_float16")
    losses, skipped = TRAINERS[model.framework](model, loss_fn, tx, steps=3)
    assert skipped == 0
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def _train_linen(model, loss_fn, tx, steps):
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(0), 3)
    variables, batch = model.init(k_init), model.batch(k_batch)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    grad_fn = jmp_policy.scaled_value_and_grad(loss_fn, has_aux=True)

    @jax.jit
    def step(params, rest, opt_state, key):
        scale = jmp_policy.get_loss_scale(opt_state)
        (loss, aux), grads = grad_fn(scale, params, rest, batch, key, True)
        updates, opt_state = tx.update(grads, opt_state, params)
        rest = {k: aux.get(k, v) for k, v in rest.items()}
        return optax.apply_updates(params, updates), rest, opt_state, loss

    opt_state, losses = tx.init(params), []
    for i in range(steps):
        params, rest, opt_state, loss = step(params, rest, opt_state, jax.random.fold_in(k_drop, i))
        losses.append(float(loss))
    return losses, int(opt_state.skipped_steps)


def _train_nnx(model, loss_fn, tx, steps):
    k_init, k_batch = jax.random.split(jax.random.key(0))
    module, batch = model.init(k_init), model.batch(k_batch)
    optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)
    grad_fn = jmp_policy.flax.nnx_scaled_value_and_grad(loss_fn, has_aux=True)

    @nnx.jit
    def step(module, optimizer):
        scale = jmp_policy.flax.optimizer_loss_scale(optimizer)
        (loss, _), grads = grad_fn(scale, module, batch, True)
        optimizer.update(module, grads)
        return loss

    losses = [float(step(module, optimizer)) for _ in range(steps)]
    return losses, int(jmp_policy.flax.optimizer_skipped_steps(optimizer))


def _train_eqx(model, loss_fn, tx, steps):
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(0), 3)
    module, batch = model.init(k_init), model.batch(k_batch)
    grad_fn = jmp_policy.scaled_value_and_grad(loss_fn, has_aux=True)  # floating leaves only

    @eqx.filter_jit
    def step(module, opt_state, key):
        scale = jmp_policy.get_loss_scale(opt_state)
        (loss, _), grads = grad_fn(scale, module, batch, key, True)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(module, eqx.is_inexact_array))
        return eqx.apply_updates(module, updates), opt_state, loss

    opt_state, losses = tx.init(eqx.filter(module, eqx.is_inexact_array)), []
    for i in range(steps):
        module, opt_state, loss = step(module, opt_state, jax.random.fold_in(k_drop, i))
        losses.append(float(loss))
    return losses, int(opt_state.skipped_steps)


TRAINERS = {"linen": _train_linen, "nnx": _train_nnx, "equinox": _train_eqx}
