"""Autocast on real models (tests/support/real_models.py): linen, NNX and Equinox, as users
write them.

For every model of the zoo, under ``jit`` and with dropout and padding on:
``autocast`` in ``mixed_bfloat16`` and ``mixed_float16`` gives the float32
loss and gradients to a half-precision tolerance, float8 (tensorwise and
rowwise) gives finite gradients and a close loss, a few loss-scaled float16
train steps skip no step, and no warning is raised. Each model's variants run
in one compiled program (compiling dominates this file's time). The
convolutional ResNet has no float8-eligible product: autocast warns there
(tests/test_autocast_transformation.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy
import jmp_policy.flax  # noqa: F401  (the NNX train step)
from support.excess_precision import COMPILERS

rm = pytest.importorskip("support.real_models")  # skips with flax or equinox missing
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

pytestmark = [pytest.mark.slow,  # a system test: the real-model zoo
              pytest.mark.filterwarnings("error")]  # no AutocastWarning, no unmatched rule

NAMES = sorted(rm.MODELS)
HALF = {"mixed_bfloat16": 3e-2, "mixed_float16": 1e-2}  # loss tolerance; 5x for gradients
FLOAT8 = ("tensorwise", "rowwise")


def variants(model):
    """The loss under every precision tested, by name: float32 first (the reference)."""
    losses = {"float32": model.loss}
    losses.update({p: jmp_policy.autocast(model.loss, p) for p in HALF})
    if model.name != "linen_resnet":  # convolutions: fp8 changes nothing (and warns, below)
        losses.update({s: jmp_policy.autocast(model.loss, "mixed_bfloat16", fp8=s)
                       for s in FLOAT8})
    return losses


@functools.cache
def evaluate_all(name):
    """``((loss, aux), grads)`` of every variant, train mode, one jitted program per model."""
    return evaluate(name, variants(rm.MODELS[name]))


def evaluate(name, losses, compile=jax.jit, scales=None):
    """``((loss, aux), grads)`` of each of ``losses`` (the model's loss signature), train
    mode, in one program compiled with ``compile`` (Equinox's: ``eqx.filter_jit``).

    Every loss sees the same dropout masks: linen and Equinox from the same
    key, NNX from a fresh module merged from the same state (its own Rngs).

    With ``scales`` (a list of floats), each of ``losses`` is ``scale -> loss``, given
    the scale as a traced float32 scalar: the one program runs once per scale, and the
    results come as a list, in the order of ``scales``.
    """
    model = rm.MODELS[name]
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(0), 3)
    state, batch = model.init(k_init), model.batch(k_batch)

    def grads(scale):
        fns = losses if scale is None else {k: f(scale) for k, f in losses.items()}
        return {k: model.value_and_grad(f) for k, f in fns.items()}

    if model.framework == "linen":
        params, rest = state["params"], {k: v for k, v in state.items() if k != "params"}
        program = compile(lambda p, r, b, k, s: {n: g(p, r, b, k, True)
                                                 for n, g in grads(s).items()})
        args = (params, rest, batch, k_drop)
    elif model.framework == "nnx":
        graphdef, nnx_state = nnx.split(state)
        # copy=True: each variant's module gets its own variables (RNG counters included).
        program = compile(lambda st, b, s: {n: g(nnx.merge(graphdef, st, copy=True), b, True)
                                            for n, g in grads(s).items()})
        args = (nnx_state, batch)
    else:
        program = eqx.filter_jit(lambda m, b, k, s: {n: g(m, b, k, True)
                                                     for n, g in grads(s).items()})
        args = (state, batch, k_drop)
    if scales is None:
        return program(*args, None)
    return [program(*args, jnp.float32(s)) for s in scales]


def float_leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)
            if x is not None and jnp.issubdtype(x.dtype, jnp.floating)]


def relative_error(got, want):
    got, want = float_leaves(got), float_leaves(want)
    assert len(got) == len(want)
    num = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got, want)))
    return num / np.sqrt(sum(np.sum(b ** 2) for b in want))


@pytest.mark.parametrize("name", NAMES)
def test_every_precision_matches_float32(name):
    assert_every_precision_matches_float32(evaluate_all(name))


def test_float8_matches_float32_as_on_a_gpu():
    """As XLA:GPU computes it (tests/support/excess_precision.py), for the language model: rowwise
    float8 products, whose operands autocast narrows most."""
    model = rm.MODELS["linen_lm"]
    losses = {p: f for p, f in variants(model).items() if p in ("float32", "rowwise")}
    assert_every_precision_matches_float32(
        evaluate("linen_lm", losses, COMPILERS["jit, excess precision as on a GPU"]))


def assert_every_precision_matches_float32(runs):
    (want, want_aux), want_grads = runs["float32"]
    assert all(np.isfinite(x).all() for x in float_leaves((want, want_aux, want_grads)))
    for policy, tol in HALF.items():
        if policy not in runs:
            continue
        (loss, aux), grads = runs[policy]
        assert loss.dtype == jnp.float32, policy  # a loss is never narrowed: float32 class
        assert abs(float(loss) - float(want)) <= tol * abs(float(want)), policy
        assert relative_error(grads, want_grads) <= 5 * tol, policy
        for got, ref in zip(jax.tree.leaves(aux), jax.tree.leaves(want_aux)):
            assert got.dtype == ref.dtype, policy  # BatchNorm statistics stay float32
    for scaling in FLOAT8:
        if scaling not in runs:
            continue
        (loss, _), grads = runs[scaling]
        # Finite with padding rows of zeros and dropout under jit; close to float32.
        assert all(np.isfinite(g).all() for g in float_leaves(grads)), scaling
        assert abs(float(loss) - float(want)) <= 0.05 * abs(float(want)), scaling
        assert relative_error(grads, want_grads) <= 0.3, scaling


@pytest.mark.parametrize("name", NAMES)
def test_float8_residuals_match_float32(name):
    """``residuals="float8"``: the same loss as bfloat16 autocast computes (the forward pass
    is unchanged), and gradients from float8 roots within 15% of float32's, finite with
    dropout, padding and BatchNorm, on every framework's models."""
    model = rm.MODELS[name]
    runs = evaluate(name, {
        "float32": model.loss,
        "float8 residuals": jmp_policy.autocast(model.loss, "mixed_bfloat16", residuals="float8")})
    (want, _), want_grads = runs["float32"]
    (loss, _), grads = runs["float8 residuals"]
    assert all(np.isfinite(g).all() for g in float_leaves(grads))
    assert abs(float(loss) - float(want)) <= HALF["mixed_bfloat16"] * abs(float(want))
    assert relative_error(grads, want_grads) <= 0.15


def test_float8_residuals_match_float32_as_on_a_gpu():
    """As XLA:GPU computes it (tests/support/excess_precision.py), which removes float round
    trips the library does not make again: the language model's stored roots are still
    rounded to float8, with and without float8 products, and the gradients stay close."""
    model = rm.MODELS["linen_lm"]
    losses = {"float32": model.loss}
    for fp8 in (None, "rowwise"):
        losses[f"{fp8}"] = jmp_policy.autocast(model.loss, "mixed_bfloat16", fp8=fp8,
                                               residuals="float8")
    runs = evaluate("linen_lm", losses, COMPILERS["jit, excess precision as on a GPU"])
    (want, _), want_grads = runs["float32"]
    for fp8 in ("None", "rowwise"):
        (loss, _), grads = runs[fp8]
        assert all(np.isfinite(g).all() for g in float_leaves(grads)), fp8
        assert abs(float(loss) - float(want)) <= 0.05 * abs(float(want)), fp8
        assert 0 < relative_error(grads, want_grads) <= 0.15, fp8


@pytest.mark.parametrize("name", NAMES)
def test_loss_scaled_float16_steps_skip_nothing(name):
    model = rm.MODELS[name]
    loss_fn = jmp_policy.autocast(model.loss, "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adam(3e-3), "mixed_float16")
    losses, skipped = TRAINERS[model.framework](model, loss_fn, tx, steps=15)
    assert skipped == 0
    # The model learns its fixed batch in float16 (float32: 0.03 to 0.43 of the first
    # loss after 30 steps of adam(3e-3)).
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


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

    opt_state, losses = jax.jit(tx.init)(params), []  # eagerly, a program per leaf shape
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

    opt_state, losses = jax.jit(tx.init)(eqx.filter(module, eqx.is_inexact_array)), []
    for i in range(steps):
        module, opt_state, loss = step(module, opt_state, jax.random.fold_in(k_drop, i))
        losses.append(float(loss))
    return losses, int(opt_state.skipped_steps)


TRAINERS = {"linen": _train_linen, "nnx": _train_nnx, "equinox": _train_eqx}
