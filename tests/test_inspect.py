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
from support.excess_precision import COMPILERS, inspect_as_on_a_gpu

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


# The numerics tests run the inspector's program as XLA:CPU compiles it, and as XLA:GPU
# does (tests/support/excess_precision.py): its counts must be those of what each computes.
@pytest.fixture(params=list(COMPILERS))
def compiler(request, monkeypatch):
    if request.param != "jit":
        inspect_as_on_a_gpu(monkeypatch)
    return request.param


@pytest.fixture(scope="module")
def gpu_report():
    with pytest.MonkeyPatch.context() as monkeypatch:
        inspect_as_on_a_gpu(monkeypatch)
        return jmp_policy.inspect_numerics(loss_fn, "mixed_float16", argnums=0)(PARAMS, X, T)


@pytest.fixture
def compiled_report(request, compiler):
    """The main model's report as ``compiler`` computes it."""
    return request.getfixturevalue("report" if compiler == "jit" else "gpu_report")


def _keys(rows):
    return [(r.scope, r.phase, r.primitive) for r in rows]


# --- The planted overflow and underflow ----------------------------------------------------

# Autocast's program rounds x * 1000 to float16 in boom: two values become inf there, and
# the product, the mean and the loss downstream receive them. Its backward pass casts the
# loss's cotangent (~1e-10) to float16 where the loss widened the model's float16 output
# (the `astype` in loss_fn, outside any scope): every value becomes zero there, and the
# products downstream compute zeros from zeros.
OVERFLOWS = [("boom", "forward", "convert_element_type")]
UNDERFLOWS = [("", "backward", "convert_element_type")]


def test_worst_rows_are_the_planted_overflow_and_underflow(compiled_report):
    assert _keys(compiled_report.worst(2)) == OVERFLOWS + UNDERFLOWS
    assert _keys(r for r in compiled_report if r.overflow) == OVERFLOWS
    assert _keys(r for r in compiled_report if r.underflow) == UNDERFLOWS
    assert compiled_report.worst(3)[2].overflow == 0 and compiled_report.worst(3)[2].underflow == 0


def test_overflow_count_is_the_hand_count(compiled_report):
    (cast,) = [r for r in compiled_report if r.overflow]
    assert cast.overflow == (np.abs(X * 1000.0) > F16_MAX).sum() == 2  # the two values
    assert cast.dtype == "float16" and cast.size == B * D
    # The product receives the two infs: its own result loses nothing more.
    (product,) = [r for r in compiled_report if _keys([r]) == [("boom", "forward", "dot_general")]]
    assert product.overflow == 0 and product.size == B * F
    # The largest finite result: the rows without an inf operand.
    finite = ~(np.abs(X * 1000.0) > F16_MAX).any(axis=1)
    products = _half(X[finite] * 1000.0) @ _half(P)
    np.testing.assert_allclose(product.max_abs, np.abs(products).max(), rtol=1e-3)


def _half(a):
    return a.astype(np.float16).astype(np.float32)


def _autocast_grads():
    mixed = jmp_policy.autocast(model, "mixed_float16")
    return jax.grad(lambda p: loss_fn(p, X, T, apply=mixed))(PARAMS)


def test_underflow_is_the_hand_computation_and_what_autocast_computes(compiled_report):
    h = np.tanh(X @ PARAMS["w1"])
    y = h @ PARAMS["w2"]
    g = LOSS_FACTOR * 2 * (y - T) / y.size          # d loss / d y, below float16's range
    assert (_half(g) == 0).all() and (g != 0).all()
    (cast,) = [r for r in compiled_report if r.underflow]
    assert (cast.size, cast.underflow, cast.rel_error, cast.max_abs) == (g.size, 1.0, 1.0, 0.0)
    np.testing.assert_allclose(cast.float32_max, np.abs(g).max(), rtol=1e-2)
    # Downstream, autocast's backward pass computes zeros from zeros, as jax.grad says.
    backward = [r for r in compiled_report if r.phase == "backward" and r is not cast]
    assert backward and all(r.max_abs == 0.0 and r.underflow == 0.0 for r in backward)
    assert all((np.asarray(v) == 0).all() for v in jax.tree.leaves(_autocast_grads()))


def test_an_overflow_is_counted_where_it_happens_not_downstream(compiled_report):
    # The inf reaches the product after the cast, and the mean and the loss (in
    # float32: no rows); the product has no overflow of its own.
    downstream = [r for r in compiled_report if _keys([r]) != OVERFLOWS and r.phase == "forward"]
    assert [r.scope for r in downstream if r.scope == "boom"] == ["boom"]
    assert downstream and all(r.overflow == 0 for r in downstream)


def test_autocast_of_the_model_overflows_and_the_suggested_rules_fix_it(compiled_report):
    rules = compiled_report.suggest_rules()
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


@pytest.mark.slow  # a system test: a training run
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


def test_the_loss_scale_brings_the_gradients_into_float16s_normal_range(compiled_report):
    # Float32 gradient values of the backward pass, by hand: every intermediate of
    # dense2's and dense1's backward products and the cotangents before them.
    scale = compiled_report.suggest_loss_scale()
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
    assert (row.scope, row.primitive, row.phase, row.dtype, row.shapes) == (
        "boom", "convert_element_type", "forward", "float16", f"{B}x{D}")
    (product,) = [r for r in report if (r.scope, r.primitive) == ("boom", "dot_general")]
    assert product.shapes == f"{B}x{D}, {D}x{F}"
    for r in report:
        assert r.phase in ("forward", "backward")
        assert 0.0 <= r.underflow <= 1.0 and 0.0 <= r.subnormal <= 1.0
        assert r.rel_error >= 0.0 and r.max_abs >= 0.0 and r.size > 0
        assert r.fp8_saturated is None and r.fp8_flushed is None
    assert {r.phase for r in report} == {"forward", "backward"}


def _ran_below_float32(closed):
    """(primitive, dtype) of each equation of a jaxpr, nested ones included, with a
    floating operand or result narrower than float32."""
    found = set()
    for eqn in closed.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    found |= _ran_below_float32(getattr(sub, "jaxpr", sub))
        avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
        narrow = [a.dtype for a in avals if jnp.issubdtype(getattr(a, "dtype", int),
                                                           jnp.floating)
                  and jnp.finfo(a.dtype).bits < 32]
        if narrow:
            found.add((eqn.primitive.name, min(narrow, key=lambda d: jnp.finfo(d).bits).name))
    return found


def test_rows_are_the_operations_of_jax_grad_of_autocast_in_their_dtypes(report):
    mixed = jmp_policy.autocast(model, "mixed_float16")
    program = jax.make_jaxpr(jax.value_and_grad(lambda p: loss_fn(p, X, T, apply=mixed)))(
        PARAMS)
    assert {(r.primitive, r.dtype) for r in report} <= _ran_below_float32(program.jaxpr)
    # Operations autocast runs in float32 (tanh's derivative, the loss) lose nothing
    # against float32: they have no rows.
    assert all(r.dtype != "float32" for r in report)


def test_report_is_a_sequence_and_a_table(report):
    assert len(report) == len(report.rows) and report[0] == report.rows[0]
    assert list(report[:2]) == report.rows[:2]
    text = str(report.worst(3))
    lines = text.splitlines()
    assert "mixed_float16" in lines[0] and "1 overflowing" in lines[0]
    assert lines[1].split("|")[0].strip() == "scope" and "rel_error" in lines[1]
    assert "shapes" in lines[1]
    assert lines[3].startswith("boom ") and len(lines) == 3 + 3 + 2
    # The table ends with the next step: the suggested rules and loss scale.
    scale = report.suggest_loss_scale()
    assert lines[-2] == f"Next: autocast(loss_fn, 'mixed_float16', rules={report.suggest_rules()!r})"
    assert lines[-1].split() == ["with", "the", "loss", "scaled", "by",
                                 f"2**{int(np.log2(scale))}", "=", f"{scale:g}",
                                 "(NumericsReport.suggest_loss_scale)"]


def test_a_forward_report_ends_with_the_autocast_call_to_make():
    def fn(x, w):
        return x @ w

    x, w = jnp.ones((32, 32)), jnp.ones((32, 32))
    plain = str(jmp_policy.inspect_numerics(fn, "mixed_float16")(x, w)).splitlines()
    assert plain[-1] == "Next: autocast(fn, 'mixed_float16')"  # nothing to pin, no loss scale
    fp8 = str(jmp_policy.inspect_numerics(fn, "mixed_bfloat16", fp8="tensorwise")(x, w))
    assert fp8.splitlines()[-1] == "Next: autocast(fn, 'mixed_bfloat16', fp8='tensorwise')"


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


@pytest.mark.slow  # a system test: a fresh child interpreter
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


def test_jit_changes_nothing(report):
    inspect = jmp_policy.inspect_numerics(jax.jit(loss_fn), "mixed_float16", argnums=0)
    jitted = inspect(PARAMS, X, T)
    again = inspect(jax.tree.map(lambda w: w * 2, PARAMS), X, T)
    assert _keys(jitted) == _keys(again) == _keys(report)
    assert [r.max_abs for r in jitted] == [r.max_abs for r in report]
    assert [r.max_abs for r in again] != [r.max_abs for r in report]


def test_each_call_reads_closures_afresh():
    scale = {"x": 1.0}
    inspect = jmp_policy.inspect_numerics(lambda p, x, t: loss_fn(p, x * scale["x"], t),
                                          "mixed_float16", argnums=0)
    assert any(r.overflow for r in inspect(PARAMS, X, T))
    scale["x"] = 1e-3  # read at call time, as autocast reads it: no value beyond 65504
    assert not any(r.overflow for r in inspect(PARAMS, X, T))


def test_loops_branches_and_remat(compiler):
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
    (cast,) = [r for r in rows("cell", "convert_element_type") if r.shapes == "4x16"]
    assert cast.size == 5 * 4 * 16
    assert cast.overflow == 2 * 4 * 16               # the two overflowing iterations
    assert rows("cell", "dot_general", "backward")    # the transposed scan's products
    (loop,) = rows("loop", "dot_general")
    assert loop.size == 3 * 4 * 16                   # three iterations
    (branch,) = rows("branch", "dot_general")
    assert branch.size == 4 * 16
    # checkpoint: the layer is computed, then computed again for the backward pass
    # (forward values both times), and differentiated.
    assert len(rows("layer", "dot_general")) == 2
    assert rows("layer", "dot_general", "backward")
    assert all(r.shapes != "-" for r in report)       # every row rounds operands


def test_flax_nnx_modules_as_arguments():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def loss(model, x):
        with jax.named_scope("linear"):
            return jnp.mean(model(x) ** 2)

    report = jmp_policy.inspect_numerics(loss, "mixed_bfloat16", argnums=0)(model, jnp.ones((2, 3)))
    products = [r for r in report if r.primitive == "dot_general"]
    # The module's own path (its class name) inside the user's scope.
    assert {(r.scope, r.phase, r.dtype) for r in products} == {
        ("linear/Linear", "forward", "bfloat16"), ("linear/Linear", "backward", "bfloat16")}
    assert not any(r.scope == "" for r in report)


def _load_lm():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "transformer_lm.py")
    spec = importlib.util.spec_from_file_location("_inspect_transformer_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a system test: examples/transformer_lm.py
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
    # Every row is in a module, but the cast of the logits to the policy's output dtype,
    # which autocast makes outside the model.
    assert [(r.scope, r.primitive) for r in report if not r.scope.startswith("TransformerLM/")
            ] == [("", "convert_element_type")]


# --- Float8 ---------------------------------------------------------------------------------

def test_float8_products_count_flushed_operands_forward_and_backward(compiler):
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
    assert forward.overflow == 0
    # The counts are those of the casts to float8 that made its operands.
    (cast,) = [r for r in report if r.underflow and r.dtype == "float8_e4m3fn"]
    assert (cast.primitive, cast.phase, cast.overflow, cast.size) == (
        "convert_element_type", "forward", 0, 32 * 32)
    assert cast.underflow == 4 / (32 * 32) and cast.rel_error > 0
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


def test_suggest_rules_keeps_the_given_rules(compiler):
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
    with pytest.raises(ValueError, match=r"must be one floating-point scalar.*\[2, 16\]"):
        inspect(jnp.ones((2, 16)))


def test_argnums_on_integer_arguments_is_refused():
    inspect = jmp_policy.inspect_numerics(lambda i, x: jnp.sum(x[i]), "mixed_float16", argnums=0)
    with pytest.raises(ValueError, match="argument 0 .* no floating-point"):
        inspect(jnp.arange(2), jnp.ones((3, 2)))


def test_inspecting_under_a_trace_is_refused():
    inspect = jmp_policy.inspect_numerics(lambda x: jnp.sum(x * 2), "mixed_float16")
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(inspect)(jnp.ones(3))


# --- What autocast's program has, and only that --------------------------------------------

def test_a_backward_overflow_of_autocast_is_reported(compiler):
    # The weight gradient sums 100000 products into float16: inf in autocast's program.
    def f(w, x):
        with jax.named_scope("sum"):
            return jnp.sum(x @ w)

    w, x = jnp.full((4, 1), 1e-3), jnp.ones((100_000, 4))
    grad = jax.grad(jmp_policy.autocast(f, "mixed_float16"))(w, x)
    assert not np.isfinite(np.asarray(grad)).all()
    report = jmp_policy.inspect_numerics(f, "mixed_float16", argnums=0)(w, x)
    (row,) = [r for r in report if r.overflow]
    assert (row.scope, row.primitive, row.phase, row.dtype) == (
        "sum", "dot_general", "backward", "float16")
    assert row.overflow == 4 and row.float32_max == pytest.approx(1e5)


def test_what_autocast_computes_in_float32_is_not_reported(compiler):
    # A sum of squares beyond float16's range, and an RMS statistic of tiny values:
    # autocast computes both in float32 (squares are float32-class), so neither
    # overflows nor caps the loss scale.
    def f(w, x):
        with jax.named_scope("rms"):
            h = x @ w
            return jnp.sqrt(jnp.mean(h ** 2)) * 1e-6

    w, x = jnp.full((8, 8), 100.0), jnp.ones((4, 8))
    report = jmp_policy.inspect_numerics(f, "mixed_float16", argnums=0)(w, x)
    assert np.isfinite(jax.grad(jmp_policy.autocast(f, "mixed_float16"))(w, x)).all()
    assert not any(r.overflow for r in report)
    assert {r.primitive for r in report} <= {"convert_element_type", "dot_general"}
    scale = report.suggest_loss_scale()
    grads = jmp_policy.scaled_value_and_grad(jmp_policy.autocast(f, "mixed_float16"))(
        scale, w, x)[1]
    exact = jax.grad(f)(w, x)
    assert np.isfinite(np.asarray(grads)).all()  # scaled, held in float16: none overflows
    np.testing.assert_allclose(np.asarray(grads) / scale, exact, rtol=2e-2)


# --- Operations that run in half precision themselves ------------------------------------

def _half_arithmetic(x):
    with jax.named_scope("boom"):
        y = x * 32768.0                 # float16 arithmetic on float16 inputs
    return jnp.mean(jnp.sum(y, axis=-1)) * 1e-6


def test_half_precision_arithmetic_is_compared_with_float32(compiler):
    """A float16 ``mul`` that overflows is reported where it overflows (counted by hand),
    ``suggest_rules`` pins its scope, and the pinned function is finite; a float16 ``tanh``
    shows its rounding error. Before, each was compared with itself in float16: no
    overflow, no error."""
    x = jax.random.uniform(jax.random.key(0), (32, 64), minval=1, maxval=3).astype(jnp.float16)
    with np.errstate(over="ignore"):
        planted = int(np.isinf((np.asarray(x, np.float32) * 32768.0).astype(np.float16)).sum())
    assert planted > 500
    assert not np.isfinite(jmp_policy.autocast(_half_arithmetic, "mixed_float16")(x))
    report = jmp_policy.inspect_numerics(_half_arithmetic, "mixed_float16")(x)
    (row,) = [r for r in report if r.overflow]
    assert (row.scope, row.primitive, row.dtype, row.overflow) == ("boom", "mul", "float16",
                                                                   planted)
    rules = report.suggest_rules()
    assert rules["float32_scopes"] == ["boom"]
    assert np.isfinite(jmp_policy.autocast(_half_arithmetic, "mixed_float16", rules=rules)(x))

    tanh = jmp_policy.inspect_numerics(lambda x: jnp.tanh(x * 0.7), "mixed_float16")(x)
    (row,) = [r for r in tanh if r.primitive == "tanh"]
    h = (np.asarray(x, np.float32) * np.float32(np.float16(0.7))).astype(np.float16)
    want = np.tanh(h.astype(np.float32))  # tanh's input is the float16 product
    got = want.astype(np.float16).astype(np.float32)
    hand = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert row.dtype == "float16" and row.rel_error == pytest.approx(hand, rel=0.05)
    assert row.rel_error > 1e-5


def test_a_float32_reduction_of_half_values_stays_float32():
    """jnp.sum of float16 values computes in float32 and casts back; autocast keeps the
    float32 result (a float32 value is never narrowed), so the sum does not overflow float16 and no row reports it."""
    x = jnp.full((4, 1024), 100.0, jnp.float16)  # row sums 102400 > 65504
    f = lambda x: jnp.mean(jnp.sum(x, axis=-1))  # noqa: E731
    assert float(jmp_policy.autocast(f, "mixed_float16")(x)) == 102400.0
    assert not np.isfinite(float(f(x)))  # without autocast, JAX's cast back overflows
    assert not any(r.overflow for r in jmp_policy.inspect_numerics(f, "mixed_float16")(x))
