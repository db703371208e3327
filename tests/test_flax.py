"""jmp_policy.flax: linen constructor kwargs, per-module policies, NNX training."""

import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jmp_policy  # noqa: E402
import jmp_policy.flax as jf  # noqa: E402

F32, F16, BF16 = np.dtype("float32"), np.dtype("float16"), np.dtype("bfloat16")


@pytest.mark.slow  # a system test: a fresh child interpreter
def test_import_jmp_policy_does_not_import_flax():
    code = "import sys, jmp_policy; assert 'flax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow  # a system test: a fresh child interpreter
def test_import_without_flax_names_the_extra_to_install():
    code = """
import sys
sys.modules["flax"] = None  # as if Flax were not installed
import jmp_policy  # works without Flax
try:
    import jmp_policy.flax
except ImportError as e:
    print(type(e).__name__, e)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("ImportError ")  # not a bare ModuleNotFoundError
    assert 'pip install "jmp_policy[flax]"' in out.stdout


# ---------------------------------------------------------------------------
# module_kwargs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,compute,param", [
    ("mixed_bfloat16", BF16, F32),
    ("mixed_float16", F16, F32),
    ("float32", F32, F32),
    ("params=bfloat16,compute=bfloat16,output=float32", BF16, BF16),
])
def test_module_kwargs_builds_layers_with_policy_dtypes(name, compute, param):
    assert jf.module_kwargs(name) == {"dtype": compute, "param_dtype": param}
    layer = nn.Dense(3, **jf.module_kwargs(jmp_policy.Policy(name)))
    x = jnp.ones((2, 4), jnp.float32)
    variables = layer.init(jax.random.key(0), x)
    assert variables["params"]["kernel"].dtype == param
    assert layer.apply(variables, x).dtype == compute
    linear = nnx.Linear(4, 3, **jf.module_kwargs(name), rngs=nnx.Rngs(0))
    assert linear.kernel.dtype == param and linear(x).dtype == compute


def test_module_kwargs_none_is_the_global_policy_and_infer_is_rejected():
    with jmp_policy.policy_scope("mixed_float16"):
        assert jf.module_kwargs() == {"dtype": F16, "param_dtype": F32}
    assert jf.module_kwargs() == {"dtype": F32, "param_dtype": F32}
    with pytest.warns(DeprecationWarning):
        infer_f32 = jmp_policy.Policy("infer_float32_vars")
    assert jf.module_kwargs(infer_f32) == {"dtype": None, "param_dtype": F32}
    with pytest.warns(DeprecationWarning):
        infer = jmp_policy.Policy("infer")
    with pytest.raises(ValueError, match="no parameter dtype"):
        jf.module_kwargs(infer)


# ---------------------------------------------------------------------------
# module_policy (linen)
# ---------------------------------------------------------------------------
class LM(nn.Module):
    """Layers built in bfloat16; LayerNorm and the logits are to be kept float32."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dtype=jnp.bfloat16)(x)
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        x = nn.Dense(16, dtype=jnp.bfloat16)(x)
        return nn.Dense(5, dtype=jnp.bfloat16, name="logits")(x)


def _call_dtypes(module, variables, x):
    _, state = module.apply(variables, x, capture_intermediates=True)
    inter = state["intermediates"]
    return {k: v["__call__"][0].dtype for k, v in inter.items() if k != "__call__"}


@pytest.fixture(scope="module")
def lm_vars():
    return LM().init(jax.random.key(0), jnp.ones((2, 8)))


def test_module_policy_by_class_and_path(lm_vars):
    x = jnp.ones((2, 8))
    assert _call_dtypes(LM(), lm_vars, x) == {
        "Dense_0": BF16, "LayerNorm_0": BF16, "Dense_1": BF16, "logits": BF16}
    with jf.module_policy({nn.LayerNorm: "float32", "logits": "float32"}):
        dtypes = _call_dtypes(LM(), lm_vars, x)
        y = LM().apply(lm_vars, x)
    assert dtypes == {"Dense_0": BF16, "LayerNorm_0": F32, "Dense_1": BF16, "logits": F32}
    assert y.dtype == F32
    # Leaving the block restores the modules as constructed.
    assert LM().apply(lm_vars, x).dtype == BF16


def test_module_policy_computes_in_the_policy_dtype_not_only_casts_the_output():
    x = jax.random.normal(jax.random.key(1), (4, 32)) * 3 + 1
    x16 = x.astype(jnp.bfloat16)
    ln_bf16 = nn.LayerNorm(dtype=jnp.bfloat16)
    variables = ln_bf16.init(jax.random.key(0), x16)
    expected_f32 = nn.LayerNorm(dtype=jnp.float32).apply(variables, x16)
    with jf.module_policy({nn.LayerNorm: "float32"}):
        got = ln_bf16.apply(variables, x16)
    np.testing.assert_array_equal(got, expected_f32)
    # A bfloat16 LayerNorm merely cast to float32 would be visibly different.
    assert not np.array_equal(ln_bf16.apply(variables, x16).astype(jnp.float32), expected_f32)
    assert ln_bf16.dtype == jnp.bfloat16  # the user's module is untouched


def test_module_policy_output_dtype_and_input_cast():
    policy = jmp_policy.Policy("params=float32,compute=float32,output=bfloat16")
    dense = nn.Dense(4)
    variables = dense.init(jax.random.key(0), jnp.ones((1, 3)))
    x = jnp.ones((1, 3), jnp.float16)
    with jf.module_policy({nn.Dense: policy}):
        y = dense.apply(variables, x)
    np.testing.assert_array_equal(
        y, dense.apply(variables, x.astype(jnp.float32)).astype(jnp.bfloat16))
    assert y.dtype == BF16


def test_module_policy_sets_param_dtype_at_init_and_default_applies_to_layers_only():
    with jf.module_policy({nn.LayerNorm: "float32"}, default="params=bfloat16,compute=bfloat16"):
        variables = LM().init(jax.random.key(0), jnp.ones((2, 8)))
        y = LM().apply(variables, jnp.ones((2, 8)))
    params = variables["params"]
    assert params["Dense_0"]["kernel"].dtype == BF16
    assert params["logits"]["kernel"].dtype == BF16
    assert params["LayerNorm_0"]["scale"].dtype == F32
    # LM itself has no dtype field: the default does not cast its result.
    assert y.dtype == BF16


def test_module_policy_first_matching_rule_wins(lm_vars):
    x = jnp.ones((2, 8))
    rules = [("logits", "float16"), (nn.Dense, "float32")]
    with jf.module_policy(rules):
        dtypes = _call_dtypes(LM(), lm_vars, x)
    assert dtypes["logits"] == F16 and dtypes["Dense_0"] == F32 and dtypes["Dense_1"] == F32


def test_module_policy_under_jit_and_grad_keeps_float32_param_grads(lm_vars):
    policies = jf.module_policy({nn.LayerNorm: "float32"}, default="mixed_bfloat16")

    @jax.jit
    def loss(params, x):
        with policies:
            return LM().apply(params, x).astype(jnp.float32).sum()

    grads = jax.grad(loss)(lm_vars, jnp.ones((2, 8)))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    assert jmp_policy.all_finite(grads)
    # The decorator form is the same context.
    assert policies(lambda: LM().apply(lm_vars, jnp.ones((2, 8))))().dtype == BF16


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.LayerNorm(dtype=jnp.bfloat16)(nn.Dense(8, dtype=jnp.bfloat16)(x)), None


class _Lifted(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(8, dtype=jnp.bfloat16)(x)
        x, _ = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)()(x, None)
        return x


def test_module_policy_reaches_into_remat_and_scan():
    model = _Lifted()
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    layernorm_f32 = jmp_policy.Policy("float32", "float32", "bfloat16")  # keeps the scan carry bf16
    calls = []

    def spy(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and hasattr(context.module, "dtype"):
            calls.append((type(context.module).__name__, np.dtype(context.module.dtype), out.dtype))
        return out

    dense_f16 = jmp_policy.Policy("float32", "float16", "bfloat16")
    with jf.module_policy({nn.LayerNorm: layernorm_f32, nn.Dense: dense_f16}), \
            nn.intercept_methods(spy):  # innermost: sees the module as the policy set it
        y = jax.jit(model.apply)(variables, x)
    # Each module computed in its policy's dtype (LayerNorm in float32 inside scan,
    # Dense in float16 inside remat and scan); the spy sees the raw results.
    assert set(calls) == {("LayerNorm", F32, F32), ("Dense", F16, F16)}
    assert len(calls) >= 3  # the remat Dense, and the Dense and LayerNorm in the scan body
    assert y.dtype == BF16  # results handed on in the policies' output dtype
    calls.clear()
    with jf.module_policy({"CheckpointDense_0": dense_f16}), nn.intercept_methods(spy):
        model.apply(variables, x)  # a path rule reaches the remat-wrapped module only
    assert set(calls) == {("Dense", F16, F16), ("Dense", BF16, BF16), ("LayerNorm", BF16, BF16)}


def test_module_policy_is_reusable_and_reentrant(lm_vars):
    x = jnp.ones((2, 8))
    policies = jf.module_policy({"logits": "float32"})
    with policies:
        with policies:
            assert LM().apply(lm_vars, x).dtype == F32
        assert LM().apply(lm_vars, x).dtype == F32
    assert LM().apply(lm_vars, x).dtype == BF16
    with policies:
        assert LM().apply(lm_vars, x).dtype == F32


class _Rendezvous(nn.Module):
    barrier: object

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(4, dtype=jnp.float32)(x)
        self.barrier.wait(timeout=30)  # both threads are inside their `with` now
        return nn.Dense(4, dtype=jnp.float32, name="out")(y)


def test_module_policy_is_thread_local():
    # A one-party barrier never waits: init and a plain apply run straight through.
    variables = _Rendezvous(threading.Barrier(1)).init(jax.random.key(0), jnp.ones((1, 3)))
    model = _Rendezvous(threading.Barrier(2))
    results = {}

    def worker(name, rules):
        with jf.module_policy(rules):
            results[name] = model.apply(variables, jnp.ones((1, 3))).dtype

    threads = [threading.Thread(target=worker, args=("f16", {"out": "float16"})),
               threading.Thread(target=worker, args=("plain", {"Dense_0": "float32"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {"f16": F16, "plain": F32}


def test_module_policy_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"rule #0: '\(' is not a valid regular expression"):
        jf.module_policy({"(": "float32"})
    with pytest.raises(TypeError, match=r"flax\.linen\.Module subclass .* or a path regex"):
        jf.module_policy({int: "float32"})
    with pytest.raises(TypeError, match="LayerNorm is a flax.nnx.* use set_nnx_policy"):
        jf.module_policy({nnx.LayerNorm: "float32"})
    with pytest.raises(TypeError, match="LayerNorm is a flax.linen.* use module_policy"):
        jf.set_nnx_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), rules={nn.LayerNorm: "float32"})
    with pytest.raises(ValueError, match=r"rule #1 .*Unknown dtype"):
        jf.module_policy([(nn.Dense, "float32"), (nn.LayerNorm, "float33")])
    with pytest.raises(TypeError, match=r"\(key, policy\) pair"):
        jf.module_policy([nn.Dense])
    with pytest.raises(TypeError, match="mapping or a sequence"):
        jf.module_policy("LayerNorm")


# ---------------------------------------------------------------------------
# NNX
# ---------------------------------------------------------------------------
class MLP(nnx.Module):
    def __init__(self, policy, rngs):
        kw = jf.module_kwargs(policy)
        self.hidden = nnx.Linear(4, 32, **kw, rngs=rngs)
        self.norm = nnx.LayerNorm(32, **kw, rngs=rngs)
        self.out = nnx.Linear(32, 3, **kw, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(nnx.relu(self.hidden(x))))


def _data():
    x = jax.random.normal(jax.random.key(1), (64, 4))
    y = jnp.argmax(x[:, :3], axis=-1)
    return x, y


def _loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def test_nnx_value_and_grad_under_policy_keeps_float32_params_and_grads():
    model = MLP("mixed_bfloat16", nnx.Rngs(0))
    x, y = _data()

    @nnx.jit
    def step(model, x, y):
        assert model(x).dtype == BF16  # traced under the policy's compute dtype
        return nnx.value_and_grad(_loss)(model, x, y)

    loss, grads = step(model, x, y)
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    assert jnp.isfinite(loss)


@pytest.mark.slow  # a system test: a training run
def test_nnx_optimizer_with_loss_scaling_trains_and_skips_overflowing_steps():
    model = MLP("mixed_float16", nnx.Rngs(0))
    tx = jmp_policy.loss_scaling(optax.adam(1e-2), jmp_policy.Policy("mixed_float16"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _data()
    grad_fn = jf.nnx_scaled_value_and_grad(_loss)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = grad_fn(jf.optimizer_loss_scale(optimizer), model, x, y)
        optimizer.update(model, grads)
        return loss

    # The loss scale lives in the optimizer state.
    assert float(jf.optimizer_loss_scale(optimizer).loss_scale) == 2.0**15
    # Inputs beyond float16's range (65504) give non-finite grads: the step is skipped.
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    train_step(model, optimizer, x * 1e6, y)
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert float(jf.optimizer_loss_scale(optimizer).loss_scale) == 2.0**14
    assert int(jf.optimizer_skipped_steps(optimizer)) == 1

    first = float(train_step(model, optimizer, x, y))
    for _ in range(30):
        last = float(train_step(model, optimizer, x, y))
    assert last < 0.5 * first
    assert int(jf.optimizer_skipped_steps(optimizer)) == 1
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}
    assert jmp_policy.all_finite(nnx.state(model, nnx.Param))


def test_nnx_scaled_value_and_grad_returns_scaled_grads_and_unscaled_loss():
    model = MLP("float32", nnx.Rngs(0))
    x, y = _data()
    scale = jmp_policy.StaticLossScale(np.float32(8.0))
    loss, grads = jf.nnx_scaled_value_and_grad(_loss)(scale, model, x, y)
    ref_loss, ref_grads = nnx.value_and_grad(_loss)(model, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, 8.0 * r, rtol=1e-5, atol=1e-7),
                 grads, ref_grads)
    (loss2, aux), _ = jf.nnx_scaled_value_and_grad(
        lambda m: (_loss(m, x, y), "aux"), has_aux=True)(scale, model)
    assert aux == "aux" and np.isclose(loss2, ref_loss)


def test_set_nnx_policy_with_per_class_rules():
    model = MLP("float32", nnx.Rngs(0))
    jf.set_nnx_policy(model, "params=bfloat16,compute=bfloat16", rules={nnx.LayerNorm: "float32"})
    assert model.hidden.dtype == BF16 and model.out.dtype == BF16
    assert model.hidden.kernel.dtype == BF16  # existing params cast to the new param dtype
    assert model.norm.dtype == F32 and model.norm.scale.dtype == F32
    x, _ = _data()
    assert model(x).dtype == BF16
    jf.set_nnx_policy(model, "float32", rules=[("out", "float16")])
    assert model.hidden.kernel.dtype == F32 and model.out.kernel.dtype == F16
    assert model(x).dtype == F16


def test_set_nnx_policy_rejects_what_is_not_an_nnx_module():
    with pytest.raises(TypeError, match=r"expects a flax\.nnx\.Module, got flax\.linen.*Dense; "
                                        r"linen modules take a policy through module_kwargs"):
        jf.set_nnx_policy(nn.Dense(3), "mixed_float16")
    with pytest.raises(TypeError, match=r"expects a flax\.nnx\.Module, got builtins\.dict"):
        jf.set_nnx_policy({"w": jnp.ones(2)}, "mixed_float16")  # type: ignore[type-var]
    model = MLP("float32", nnx.Rngs(0))
    assert jf.set_nnx_policy(model, "mixed_float16") is model


# ---------------------------------------------------------------------------
# Rules that match nothing
# ---------------------------------------------------------------------------
def test_module_policy_warns_once_for_a_rule_that_matched_no_module(lm_vars):
    x = jnp.ones((2, 8))
    policies = jf.module_policy({"LayerNrom": "float32", nn.Conv: "float32", "logits": "float32"})
    with pytest.warns(jmp_policy.UnmatchedRuleWarning) as record:
        with policies:
            with policies:
                LM().apply(lm_vars, x)
            assert not record  # reported when the outermost block ends
    assert [str(w.message).split(";")[0] for w in record] == [
        "module_policy rule #0 ('LayerNrom') matched no module called in the with block",
        "module_policy rule #1 (Conv) matched no module called in the with block"]
    assert "'LayerNorm_0'" in str(record[0].message) or "'Dense_0'" in str(record[0].message)
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with policies:  # each rule is reported once, not on every step
            LM().apply(lm_vars, x)
        with jf.module_policy({"LayerNrom": "float32"}):
            pass  # no module called: nothing to report
        with pytest.raises(RuntimeError):
            with jf.module_policy({"LayerNrom": "float32"}):
                LM().apply(lm_vars, x)
                raise RuntimeError("the block did not finish")
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match="LayerNrom"):
        jf.module_policy({"LayerNrom": "float32"})(LM().apply)(lm_vars, x)  # as a decorator
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match="LayerNrom"):
        jax.jit(jf.module_policy({"LayerNrom": "float32"})(LM().apply))(lm_vars, x)  # tracing


def test_set_nnx_policy_warns_for_a_rule_that_matched_no_submodule():
    model = MLP("float32", nnx.Rngs(0))
    with pytest.warns(jmp_policy.UnmatchedRuleWarning,
                      match=r"set_nnx_policy rule #1 \('LayerNrom'\) matched no submodule.*'hidden'"
                      ) as record:
        jf.set_nnx_policy(model, "mixed_bfloat16", rules=[(nnx.LayerNorm, "float32"),
                                                          ("LayerNrom", "float32")])
    assert len(record) == 1 and record[0].filename == __file__
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match=r"rule #0 \(Conv\)"):
        jf.set_nnx_policy(model, "float32", rules={nnx.Conv: "float16"})
    assert model.norm.dtype == F32 and model.hidden.dtype == F32


def test_nnx_scaled_value_and_grad_takes_what_scaled_value_and_grad_takes():
    # One implementation: a plain number as the scale, the same checks.
    model = MLP("float32", nnx.Rngs(0))
    x, y = _data()
    loss, grads = jf.nnx_scaled_value_and_grad(_loss)(8.0, model, x, y)
    _, ref = jf.nnx_scaled_value_and_grad(_loss)(jmp_policy.StaticLossScale(8.0), model, x, y)
    jax.tree.map(np.testing.assert_array_equal, grads, ref)
    with pytest.raises(TypeError, match="floating scalar loss"):
        jf.nnx_scaled_value_and_grad(lambda m: m(x))(2.0, model)
    with pytest.raises(ValueError, match="Unknown loss_scale"):
        jf.nnx_scaled_value_and_grad(_loss)("big", model, x, y)


def test_optimizer_skipped_steps_refuses_an_ambiguous_state_like_get_loss_scale():
    model = MLP("float32", nnx.Rngs(0))
    tx = optax.chain(jmp_policy.loss_scaling(optax.sgd(0.1)), jmp_policy.loss_scaling(optax.sgd(0.1)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for read in (jf.optimizer_skipped_steps, jf.optimizer_loss_scale):
        with pytest.raises(ValueError, match="ambiguous"):
            read(optimizer)
