"""The numerics inspector: jmp_policy.inspect_numerics and its NumericsReport.

The main model plants an overflow (an activation beyond float16's 65504 under
``jax.named_scope("boom")``) and an underflow (a loss whose gradients are
below float16's smallest subnormal); the report must point at exactly those,
with counts computed here by hand, and its suggestions must fix them.
"""

import importlib.util
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_policy

F16_MAX = float(np.finfo(np.float16).max)
B, D, H, O, F = 32, 4, 8, 3, 5
_rng = np.random.RandomState(0)
P = _rng.randn(D, F).astype(np.float32) + 0.1      # a fixed projection, closed over
X = _rng.randn(B, D).astype(np.float32)
X[[3, 17], 1] = 80.0                                # x * 1000 = 80000 > 65504 in two rows
T = _rng.randn(B, O).astype(np.float32)
PARAMS = {"w1": _rng.randn(D, H).astype(np.float32) * 0.5,
          "w2": _rng.randn(H, O).astype(np.float32) * 0.5}
LOSS_FACTOR = 1e-8                                  # gradients ~1e-10: zero in float16


def model(params, x):
    """A regression model, and an energy of its raw inputs (no parameters)."""
    with jax.named_scope("boom"):
        energy = jnp.mean((x * 1000.0) @ P)          # float16 operands: inf
    with jax.named_scope("dense1"):
        h = jnp.tanh(x @ params["w1"])
    with jax.named_scope("dense2"):
        y = h @ params["w2"]
    return y, energy


def loss_fn(params, x, t, apply=model):
    # The loss in float32, as mixed-precision training computes it from the model's
    # (half-precision) outputs.
    y, energy = (o.astype(jnp.float32) for o in apply(params, x))
    return LOSS_FACTOR * (jnp.mean((y - t) ** 2) + 1e-9 * energy)


@pytest.fixture(scope="module")
def report():
    return jmp_policy.inspect_numerics(loss_fn, "mixed_float16", argnums=0)(PARAMS, X, T)


def _keys(rows):
    return [(r.scope, r.phase, r.primitive) for r in rows]


# --- The planted overflow and underflow ----------------------------------------------------

# The products of the gradient path: both of dense2's (the gradients of h and w2) and
# dense1's (the gradient of w1; x is not differentiated).
GRADIENT_PATH = [("dense2", "backward", "dot_general")] * 2 + [("dense1", "backward",
                                                                  "dot_general")]


def test_worst_rows_are_the_planted_overflow_and_underflow(report):
    worst = report.worst(4)
    assert _keys(worst) == [("boom", "forward", "dot_general")] + GRADIENT_PATH
    assert _keys(r for r in report if r.overflow) == [("boom", "forward", "dot_general")]
    assert _keys(r for r in report if r.underflow) == GRADIENT_PATH
    assert report.worst(5)[4].overflow == 0 and report.worst(5)[4].underflow == 0


def test_overflow_count_is_the_hand_count(report):
    (row,) = [r for r in report if r.overflow]
    # Every product of a row holding an inf operand is inf or NaN: rows x columns of P.
    rows_with_inf = (np.abs(X * 1000.0) > F16_MAX).any(axis=1).sum()
    assert rows_with_inf == 2
    assert row.overflow == rows_with_inf * F
    assert row.dtype == "float16" and row.size == B * F
    # The largest finite result: the rows without an inf operand, in float32.
    finite = ~(np.abs(X * 1000.0) > F16_MAX).any(axis=1)
    products = (X[finite] * 1000.0).astype(np.float16).astype(np.float32) @ \
        P.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(row.max_abs, np.abs(products).max(), rtol=1e-3)


def _half(a):
    return a.astype(np.float16).astype(np.float32)


def test_underflow_fractions_are_the_hand_computation(report):
    # The float32 backward pass by hand, and each of its products with its operands
    # narrowed to float16 as autocast narrows them: the fraction of the float32
    # product's nonzero values that are zero in float16.
    h = np.tanh(X @ PARAMS["w1"])
    y = h @ PARAMS["w2"]
    g = LOSS_FACTOR * 2 * (y - T) / y.size          # d loss / d y
    gh = (g @ PARAMS["w2"].T) * (1 - h ** 2)        # d loss / d (x @ w1)
    expected = []
    for a, b in [(g, PARAMS["w2"].T), (h.T, g), (X.T, gh)]:
        ref, low = a @ b, _half(a) @ _half(b)
        nonzero = ref != 0
        expected.append(((low == 0) & nonzero).sum() / nonzero.sum())
    rows = [r for r in report if r.underflow]
    assert sorted(r.underflow for r in rows) == sorted(expected)
    assert expected == [1.0] * 3  # every gradient value on the path is below float16's range
    assert all(r.rel_error == 1.0 and r.max_abs == 0.0 for r in rows)


def test_an_overflow_is_counted_where_it_happens_not_downstream(report):
    # The inf reaches mean, mul and add after the product, and the loss; none of them
    # has an overflow row of its own.
    downstream = [r for r in report if r.scope in ("boom", "") and r.phase == "forward"
                  and r.primitive != "dot_general"]
    assert downstream and all(r.overflow == 0 for r in downstream)


def test_autocast_of_the_model_overflows_and_the_suggested_rules_fix_it(report):
    rules = report.suggest_rules()
    assert rules == {"float32_scopes": ["boom"]}
    _, broken = jmp_policy.autocast(model, "mixed_float16")(PARAMS, X)
    assert not np.isfinite(broken)
    fixed = jmp_policy.autocast(model, "mixed_float16", rules=rules)(PARAMS, X)
    exact = model(PARAMS, X)
    assert [a.dtype for a in fixed] == [jnp.float16, jnp.float32]  # a product; a mean
    for a, b in zip(fixed, exact):
        a = np.asarray(a, np.float32)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


def _train(loss, tx, steps, scale=None):
    params = jax.tree.map(jnp.asarray, PARAMS)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        if scale is None:
            grads = jax.grad(loss)(params, X, T)
        else:
            _, grads = jmp_policy.scaled_value_and_grad(loss)(
                jmp_policy.get_loss_scale(state), params, X, T)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return float(loss_fn(params, X, T))  # every run judged by the float32 loss


def test_training_with_the_suggested_loss_scale_reaches_float32s_loss(report):
    scale = report.suggest_loss_scale()
    assert scale == 2.0 ** round(math.log2(scale))
    mixed_model = jmp_policy.autocast(model, "mixed_float16", rules=report.suggest_rules())

    def mixed(params, x, t):
        return loss_fn(params, x, t, apply=mixed_model)

    steps = 150
    initial = float(loss_fn(PARAMS, X, T))
    float32 = _train(loss_fn, optax.adam(3e-2), steps)
    unscaled = _train(mixed, optax.adam(3e-2), steps)
    scaled = _train(mixed, jmp_policy.loss_scaling(optax.adam(3e-2), scale), steps, scale)
    assert float32 < 0.5 * initial                   # float32 learns
    assert unscaled == pytest.approx(initial, rel=1e-6)   # float16 stalls: zero gradients
    assert scaled == pytest.approx(float32, rel=0.02)


def test_the_loss_scale_brings_the_gradients_into_float16s_normal_range(report):
    # Float32 gradient values of the backward pass, by hand: every intermediate of
    # dense2's and dense1's backward products and the cotangents before them.
    scale = report.suggest_loss_scale()
    h = np.tanh(X @ PARAMS["w1"])
    y = h @ PARAMS["w2"]
    g = LOSS_FACTOR * 2 * (y - T) / y.size
    dh = g @ PARAMS["w2"].T
    values = np.concatenate([a.ravel() for a in (g, dh, h.T @ g, X.T @ (dh * (1 - h**2)))])
    values = np.abs(values[values != 0]) * scale
    assert values.max() <= F16_MAX
    assert np.mean(values >= np.finfo(np.float16).tiny) >= 0.999


# --- The report ------------------------------------------------------------------------------

def test_rows_have_the_documented_fields(report):
    row = report.worst(1)[0]
    assert (row.scope, row.primitive, row.phase, row.dtype) == (
        "boom", "dot_general", "forward", "float16")
    for r in report:
        assert r.phase in ("forward", "backward")
        assert 0.0 <= r.underflow <= 1.0 and 0.0 <= r.subnormal <= 1.0
        assert r.rel_error >= 0.0 and r.max_abs >= 0.0 and r.size > 0
        assert r.fp8_saturated is None and r.fp8_flushed is None
    exact = [r for r in report if r.dtype == "float32"]
    assert exact and all(r.rel_error == 0.0 and r.overflow == 0 for r in exact)
    assert {r.phase for r in report} == {"forward", "backward"}


def test_report_is_a_sequence_and_a_table(report):
    assert len(report) == len(report.rows) and report[0] == report.rows[0]
    assert list(report[:2]) == report.rows[:2]
    text = str(report.worst(3))
    lines = text.splitlines()
    assert "mixed_float16" in lines[0] and "1 overflowing" in lines[0]
    assert lines[1].split("|")[0].strip() == "scope" and "rel_error" in lines[1]
    assert lines[3].startswith("boom ") and len(lines) == 3 + 3


def test_to_json_round_trips(report):
    document = json.loads(report.to_json())
    assert document["policy"] == "mixed_float16" and document["backward"] is True
    assert len(document["rows"]) == len(report)
    assert document["rows"][0] == {k: getattr(report[0], k) for k in document["rows"][0]}


def test_plot_writes_an_image(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ranges.png"
    report.plot(str(path))
    assert path.read_bytes().startswith(b"\x89PNG")


def test_plot_without_matplotlib_names_the_extra(report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"jmp_policy\[examples\]"):
        report.plot(str(tmp_path / "x.png"))


def test_import_does_not_import_matplotlib_or_flax():
    import subprocess

    code = "import sys, jmp_policy; print('matplotlib' in sys.modules, 'flax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- Calls, transformations and models ----------------------------------------------------

W = np.random.RandomState(1).randn(16, 16).astype(np.float32) / 4


def _layer(h, w):
    with jax.named_scope("layer"):
        return jnp.tanh(h @ w)


def test_one_program_per_call_signature_and_jit_changes_nothing(report):
    traces = []

    def f(params, x, t):
        traces.append(1)
        return loss_fn(params, x, t)

    inspect = jmp_policy.inspect_numerics(jax.jit(f), "mixed_float16", argnums=0)
    jitted = inspect(PARAMS, X, T)
    again = inspect(jax.tree.map(lambda w: w * 2, PARAMS), X, T)
    assert len(traces) == 1                          # traced and compiled once
    assert _keys(jitted) == _keys(again) == _keys(report)
    assert [r.max_abs for r in jitted] == [r.max_abs for r in report]
    assert [r.max_abs for r in again] != [r.max_abs for r in report]


def test_loops_branches_and_remat():
    # A scan whose iterations 1 and 3 multiply by 1e5 (float16 operands overflow there
    # only), a while_loop, a cond and a checkpoint, differentiated.
    scales = jnp.array([1.0, 1e5, 1.0, 1e5, 1.0])

    def f(w, x):
        def step(total, s):
            with jax.named_scope("cell"):
                y = (x * s) @ w
            return total + jnp.sum(jnp.tanh(y) * 1e-5), None

        total, _ = lax.scan(step, 0.0, scales)
        with jax.named_scope("loop"):  # not differentiable: on constants
            v = lax.stop_gradient(w)
            h, _ = lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ v), c[1] + 1),
                                  (x, 0))
        with jax.named_scope("branch"):
            h = lax.cond(jnp.sum(h) < 1e6, lambda h: jnp.tanh(h @ w), lambda h: -h, h)
        h = jax.checkpoint(_layer)(h, w)
        return total + jnp.sum(h ** 2)

    report = jmp_policy.inspect_numerics(f, "mixed_float16", argnums=0)(W, jnp.ones((4, 16)))

    def rows(scope, primitive, phase="forward"):
        return [r for r in report if (r.scope, r.primitive, r.phase) == (scope, primitive, phase)]

    (cell,) = rows("cell", "dot_general")
    assert cell.size == 5 * 4 * 16                   # one row for all five iterations
    assert cell.overflow == 2 * 4 * 16               # the two overflowing iterations
    assert rows("cell", "dot_general", "backward")    # the transposed scan's products
    (loop,) = rows("loop", "dot_general")
    assert loop.size == 3 * 4 * 16                   # three iterations
    (branch,) = rows("branch", "dot_general")
    assert branch.size == 4 * 16
    # checkpoint: the layer is computed, then computed again for the backward pass
    # (forward values both times), and differentiated.
    assert len(rows("layer", "tanh")) == 2 and not rows("layer", "tanh", "backward")
    assert rows("layer", "dot_general", "backward")


def test_flax_nnx_modules_as_arguments():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def loss(model, x):
        with jax.named_scope("linear"):
            return jnp.mean(model(x) ** 2)

    report = jmp_policy.inspect_numerics(loss, "mixed_bfloat16", argnums=0)(model, jnp.ones((2, 3)))
    products = [r for r in report if r.primitive == "dot_general"]
    assert {(r.scope, r.phase, r.dtype) for r in products} == {
        ("linear", "forward", "bfloat16"), ("linear", "backward", "bfloat16")}


def _load_lm():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "transformer_lm.py")
    spec = importlib.util.spec_from_file_location("_inspect_transformer_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


def test_the_example_transformer_lm_shows_its_module_paths():
    pytest.importorskip("flax")
    lm = _load_lm()
    config = lm.Config(d_model=16, heads=2, layers=1, seq_len=8)
    model = lm.TransformerLM(config)
    tokens = jnp.arange(16).reshape(2, 8)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    report = jmp_policy.inspect_numerics(
        lambda p, t: model.apply({"params": p}, t), "mixed_float16")(params, tokens)
    products = {r.scope for r in report if r.primitive == "dot_general"}
    assert {"TransformerLM/Block_0/CausalSelfAttention_0/qkv",
            "TransformerLM/Block_0/CausalSelfAttention_0/proj",
            "TransformerLM/Block_0/Dense_0", "TransformerLM/Block_0/Dense_1",
            "TransformerLM/logits"} <= products
    assert any(r.scope == "TransformerLM/Block_0/LayerNorm_0" for r in report)


# --- Float8 ---------------------------------------------------------------------------------

def test_float8_products_count_flushed_operands_forward_and_backward():
    # Tensorwise scaling maps the absolute maximum, 448, onto float8_e4m3fn's largest
    # value (a scale of exactly 1): values below half its smallest subnormal (2**-10)
    # flush to zero. Four such values in x; none in w.
    x = np.ones((32, 32), np.float32)
    x[0, 0] = 448.0
    x[1, :4] = 1e-4
    w = np.ones((32, 32), np.float32)
    recipe = jmp_policy.Float8Recipe("tensorwise", power_of_two_scales=True)

    def loss(w, x):
        with jax.named_scope("fp8"):
            return jnp.mean(x @ w)

    report = jmp_policy.inspect_numerics(loss, "mixed_bfloat16", fp8=recipe, argnums=0)(w, x)
    products = [r for r in report if r.primitive == "dot_general"]
    (forward,) = [r for r in products if r.phase == "forward"]
    assert forward.dtype == "float8_e4m3fn"
    assert (forward.fp8_saturated, forward.fp8_flushed) == (0, 4)
    assert forward.rel_error > 0 and forward.overflow == 0
    # The backward product takes the incoming gradient in float8_e5m2.
    assert [r.dtype for r in products if r.phase == "backward"] == ["float8_e5m2 x float8_e4m3fn"]
    assert all(r.fp8_flushed is not None for r in products)
    assert all(r.fp8_flushed is None for r in report if r.primitive != "dot_general")
    assert "fp8_flushed" in str(report).splitlines()[1]


# --- Errors ---------------------------------------------------------------------------------

def test_suggest_loss_scale_needs_the_backward_pass():
    report = jmp_policy.inspect_numerics(lambda x: _layer(x, W), "mixed_float16")(
        jnp.ones((2, 16)))
    with pytest.raises(ValueError, match="argnums"):
        report.suggest_loss_scale()


def test_suggest_rules_keeps_the_given_rules(report):
    rules = {"float32": ["tanh"], "float32_scopes": ["dense1"]}
    again = jmp_policy.inspect_numerics(loss_fn, "mixed_float16", rules=rules)(PARAMS, X, T)
    assert again.suggest_rules() == {"float32": ["tanh"], "float32_scopes": ["dense1", "boom"]}


@pytest.mark.parametrize("argnums,error,match", [
    ("0", TypeError, "int or a non-empty tuple of ints"),
    ((), TypeError, "int or a non-empty tuple of ints"),
    ((0, 1.5), TypeError, "int or a non-empty tuple of ints"),
])
def test_bad_argnums_are_refused(argnums, error, match):
    with pytest.raises(error, match=match):
        jmp_policy.inspect_numerics(loss_fn, "mixed_float16", argnums=argnums)


def test_argnums_out_of_range_names_the_positional_arguments():
    inspect = jmp_policy.inspect_numerics(loss_fn, "mixed_float16", argnums=3)
    with pytest.raises(ValueError, match=r"argnums=\(3,\).*3 positional argument"):
        inspect(PARAMS, X, T)


def test_argnums_on_a_non_scalar_output_is_refused():
    inspect = jmp_policy.inspect_numerics(lambda x: _layer(x, W), "mixed_float16", argnums=0)
    with pytest.raises(ValueError, match=r"must be one floating-point scalar.*float32\[2, 16\]"):
        inspect(jnp.ones((2, 16)))


def test_argnums_on_integer_arguments_is_refused():
    inspect = jmp_policy.inspect_numerics(lambda i, x: jnp.sum(x[i]), "mixed_float16", argnums=0)
    with pytest.raises(ValueError, match="argument 0 .* no floating-point"):
        inspect(jnp.arange(2), jnp.ones((3, 2)))


def test_inspecting_under_a_trace_is_refused():
    inspect = jmp_policy.inspect_numerics(lambda x: jnp.sum(x * 2), "mixed_float16")
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(inspect)(jnp.ones(3))
