"""The numerics inspector on real models (tests/support/real_models.py): linen, NNX and Equinox.

For every model of the zoo, in train mode (dropout and padding on), inspected
with its backward pass under ``mixed_float16``: every row is named by a module
path, and the suggested loss scale, used as a static scale, trains without a
skipped step and gives gradients as close to float32's as the default dynamic
scale's first scale does.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy

rm = pytest.importorskip("support.real_models")  # skips with flax or equinox missing
pytestmark = pytest.mark.slow  # a system test: the real-model zoo
nnx = pytest.importorskip("flax.nnx")
autocast_tests = pytest.importorskip("test_real_models_autocast")

NAMES = sorted(rm.MODELS)
DYNAMIC_INITIAL = 2.0 ** 15  # the first scale of loss_scaling(..., "mixed_float16")


def _inspect(model):
    """The report of ``model``'s float16 loss, its parameters differentiated."""
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(0), 3)
    state, batch = model.init(k_init), model.batch(k_batch)

    def loss(*args):
        return model.loss(*args)[0]

    inspect = jmp_policy.inspect_numerics(loss, "mixed_float16", argnums=0)
    if model.framework == "linen":
        params, rest = state["params"], {k: v for k, v in state.items() if k != "params"}
        return inspect(params, rest, batch, k_drop, True)
    if model.framework == "nnx":
        return inspect(state, batch, True)
    return inspect(state, batch, k_drop, True)


def _scaled(loss_fn, scale):
    def scaled(*args):
        loss, aux = loss_fn(*args)
        return loss * scale, aux
    return scaled


@pytest.mark.parametrize("name", NAMES)
def test_inspection_names_modules_and_suggests_a_scale_that_trains(name):
    model = rm.MODELS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: every primitive known, a scale fits
        report = _inspect(model)
        scale = report.suggest_loss_scale()
    # Every forward row and every product is in a module's scope; the loss, outside the
    # model, may add unscoped backward rows (its cross-entropy's gather of the
    # half-precision logits is differentiated in half precision).
    assert len(report) > 0
    assert all(row.scope for row in report if row.phase == "forward" or
               row.primitive == "dot_general")
    assert any(row.phase == "backward" for row in report)

    mixed = jmp_policy.autocast(model.loss, "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adam(3e-3), scale)  # a static scale
    _, skipped = autocast_tests.TRAINERS[model.framework](model, mixed, tx, steps=4)
    assert skipped == 0

    # One program, the scale an argument: run at the suggested scale and at the dynamic one.
    runs = autocast_tests.evaluate(name, {"float32": lambda s: model.loss,
                                          "scaled": lambda s: _scaled(mixed, s)},
                                   scales=[scale, DYNAMIC_INITIAL])
    want = runs[0]["float32"][1]
    # The unscaled gradients, divided on the host (eagerly, a program per leaf shape).
    errors = {k: autocast_tests.relative_error(
        jax.tree.map(lambda g, s=s: np.asarray(g, np.float32) / np.float32(s), run["scaled"][1]),
        want) for k, s, run in (("suggested", scale, runs[0]), ("dynamic", DYNAMIC_INITIAL, runs[1]))}
    assert errors["suggested"] <= 1.5 * errors["dynamic"] + 1e-3, (scale, errors)


# --- Suggested rules pin exactly the layer that overflows -----------------------------------

def _three_layers_nnx():
    class Three(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b, self.c = (nnx.Linear(8, 8, rngs=rngs) for _ in range(3))

        def __call__(self, x):
            return jnp.mean(self.c(jnp.tanh(self.b(jnp.tanh(self.a(x))))))

    model = Three(nnx.Rngs(0))
    model.b.kernel[...] = model.b.kernel[...] * 1e6  # beyond float16's 65504
    return model


def _three_layers_eqx():
    eqx = pytest.importorskip("equinox")

    class Three(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear
        c: eqx.nn.Linear

        def __call__(self, x):
            return jnp.mean(jax.vmap(lambda v: self.c(jnp.tanh(self.b(jnp.tanh(self.a(v))))))(x))

    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    model = Three(*(eqx.nn.Linear(8, 8, key=k) for k in (ka, kb, kc)))
    return eqx.tree_at(lambda m: m.b.weight, model, model.b.weight * 1e6)


@pytest.mark.parametrize("build", [_three_layers_nnx, _three_layers_eqx])
def test_suggested_rules_pin_exactly_the_overflowing_layer(build):
    model, x = build(), jnp.ones((4, 8))

    def loss(model, x):
        return model(x)

    report = jmp_policy.inspect_numerics(loss, "mixed_float16", argnums=0)(model, x)
    rules = report.suggest_rules()
    (scope,) = rules["float32_scopes"]
    names = scope.split("/")
    assert "b" in names and "a" not in names and "c" not in names, scope
    assert not np.isfinite(jmp_policy.autocast(loss, "mixed_float16")(model, x))
    fixed = jmp_policy.autocast(loss, "mixed_float16", rules=rules)(model, x)
    np.testing.assert_allclose(fixed, loss(model, x), rtol=1e-2)
