"""Tests for jmp_policy.policy: names, value semantics, casting, wrap, global policy."""

import copy
import dataclasses
import pickle
import threading
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy
from jmp_policy import Policy

F16, BF16, F32, F64 = (np.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))
HALF = np.dtype(jmp_policy.half_dtype())


def dtypes(p):
    return p.param_dtype, p.compute_dtype, p.output_dtype


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("float32", (F32, F32, F32)), ("f32", (F32, F32, F32)), ("full", (F32, F32, F32)),
    ("float16", (F16, F16, F16)), ("f16", (F16, F16, F16)),
    ("bfloat16", (BF16, BF16, BF16)), ("bf16", (BF16, BF16, BF16)),
    ("float64", (F64, F64, F64)), ("f64", (F64, F64, F64)),
    ("half", (HALF, HALF, HALF)),
    ("mixed_float16", (F32, F16, F16)), ("mixed_bfloat16", (F32, BF16, BF16)),
    ("float16_with_float32_vars", (F32, F16, F16)),
    ("bfloat16_with_float32_vars", (F32, BF16, BF16)),
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=f16,o=f32", (F32, F16, F32)),
    ("o=f32,c=bf16,p=f32", (F32, BF16, F32)),
    ("c=bf16", (F32, BF16, BF16)),  # params default float32, output follows compute
    ("p=f16", (F16, F16, F16)),  # compute follows params
    ("p=full,c=half", (F32, HALF, HALF)),
    ("compute=float16,output=float32", (F32, F16, F32)),
    ("params=float32, compute=bfloat16", (F32, BF16, BF16)),  # spaces around parts
])
def test_names_parse(name, expected):
    p = Policy(name)
    assert dtypes(p) == expected
    assert jmp_policy.get_policy(name) == p
    assert Policy(str(p)) == p


@pytest.mark.parametrize("name, canonical", [
    ("f32", "float32"), ("full", "float32"), ("bf16", "bfloat16"),
    ("float16_with_float32_vars", "mixed_float16"),
    ("p=f32,c=bf16", "mixed_bfloat16"),
    ("p=f32,c=bf16,o=f32", "params=float32,compute=bfloat16,output=float32"),
    ("p=f16,c=f32", "params=float16,compute=float32,output=float32"),
])
def test_canonical_name(name, canonical):
    p = Policy(name)
    assert p.name == canonical
    assert repr(p) == f'<Policy "{str(p)}">'


def test_repr_matches_spec():
    assert repr(Policy("mixed_float16")) == '<Policy "mixed_float16">'
    assert str(Policy("float32")) == "float32"


def test_construct_from_dtypes_positional_and_keyword():
    p = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    assert dtypes(p) == (F32, BF16, F32)
    assert Policy(param_dtype=np.float32, compute_dtype="bfloat16", output_dtype=jnp.float32) == p
    assert Policy("float32", "bf16", "f32") == p
    assert Policy(jnp.float16) == Policy("float16")
    assert Policy(jnp.float32, jnp.float16) == Policy("mixed_float16")
    assert Policy(p) is not None and Policy(p) == p


def test_same_policy_written_differently_is_equal_and_same_hash():
    forms = ["mixed_bfloat16", "bfloat16_with_float32_vars", "p=f32,c=bf16",
             "params=float32,compute=bfloat16,output=bfloat16", "c=bf16,o=bf16"]
    policies = [Policy(f) for f in forms] + [Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)]
    assert len(set(policies)) == 1
    assert len({hash(p) for p in policies}) == 1
    assert Policy("mixed_bfloat16") != Policy("mixed_float16")
    assert Policy("float32") != "float32"


def test_config_round_trip():
    for name in ["float32", "mixed_float16", "p=f32,c=bf16,o=f32", "half"]:
        p = Policy(name)
        config = p.get_config()
        assert config == {"name": str(p)}
        assert Policy.from_config(config) == p
    with pytest.raises(ValueError, match="from_config expects"):
        Policy.from_config({"nom": "float32"})


def test_properties():
    p = Policy("mixed_float16")
    assert p.variable_dtype == p.param_dtype == F32
    assert p.should_cast_variables
    assert not Policy("float32").should_cast_variables
    assert not Policy("p=f16,c=f16,o=f32").should_cast_variables
    q = p.with_output_dtype(jnp.float32)
    assert dtypes(q) == (F32, F16, F32) and dtypes(p) == (F32, F16, F16)
    assert q.name == "params=float32,compute=float16,output=float32"


def test_immutable_hashable_picklable():
    p = Policy("mixed_bfloat16")
    # A frozen dataclass: type checkers flag assignments too.
    assert dataclasses.is_dataclass(p)
    with pytest.raises(dataclasses.FrozenInstanceError, match="compute_dtype"):
        p.compute_dtype = F32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.other = F32  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del p.param_dtype
    assert dtypes(p) == (F32, BF16, BF16)
    assert {p: 1}[Policy("mixed_bfloat16")] == 1
    for again in (pickle.loads(pickle.dumps(p)), copy.copy(p), copy.deepcopy(p)):
        assert again == p and hash(again) == hash(p) and repr(again) == repr(p)


def test_infer_policies_differ_from_float64():
    # numpy holds np.dtype("float64") == None (np.dtype(None) is float64).
    with pytest.warns(DeprecationWarning):
        infer, infer32 = Policy("infer"), Policy("infer_float32_vars")
    assert infer != Policy("float64") and Policy("float64") != infer
    assert infer32 != Policy("params=float32,compute=float64")
    assert len({infer, infer32, Policy("float64"), Policy("params=float32,compute=float64")}) == 4


def test_name_keyword_as_keras_spells_it():
    assert Policy(name="mixed_float16") == Policy("mixed_float16")
    assert Policy(name="p=f32,c=bf16,o=f32", loss_scale=None) == Policy("p=f32,c=bf16,o=f32")
    assert repr(Policy(name="mixed_bfloat16")) == '<Policy "mixed_bfloat16">'
    with pytest.raises(TypeError, match="takes the name alone"):
        Policy(name="mixed_float16", compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="takes the name alone"):
        Policy("float32", name="mixed_float16")
    with pytest.raises(TypeError, match="takes a policy name"):
        Policy(name=jnp.float16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown dtype 'float33'"):
        Policy(name="float33")


def test_policy_is_a_leafless_pytree():
    p = Policy("mixed_float16")
    leaves, treedef = jax.tree_util.tree_flatten(p)
    assert leaves == []
    assert jax.tree_util.tree_unflatten(treedef, []) == p
    assert jax.tree_util.tree_map(lambda x: x, {"p": p, "x": 1.0})["p"] == p


# ---------------------------------------------------------------------------
# Bad names and arguments
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, match", [
    ("float33", "Unknown dtype 'float33'"),
    ("p=f32,c=float8x", "Unknown dtype 'float8x'"),
    ("mixed_float32", "unknown mixed precision type 'float32'"),
    ("foo_with_float32_vars", "Unknown dtype 'foo'"),
    ("int32", "params dtype must be floating"),
    ("p=int32", "params dtype must be floating"),
    ("p=f32,c=int8", "compute dtype must be floating"),
    ("p=f32,c=bool", "compute dtype must be floating"),
    ("", "empty part"),
    ("p=f32,", "empty part"),
    ("p=f32,,c=f16", "empty part"),
    (",float32", "empty part"),
    ("p=f32,p=f16", "'params' is given twice"),
    ("p=f32,params=f16", "'params' is given twice"),
    ("c=f16,compute=f16", "'compute' is given twice"),
    ("q=f32", "unknown key 'q'"),
    ("params=", "empty value"),
    ("p=f32=f16", "not of the form key=value"),
    ("float32,c=f16", "cannot be combined"),
    ("float32,float16", "not of the form key=value"),
    ("mixed_float16,loss_scale=sometimes", "Unknown loss_scale 'sometimes'"),
])
def test_bad_names_raise_value_error_naming_the_part(name, match):
    with pytest.raises(ValueError, match=match) as info:
        Policy(name)
    message = str(info.value)
    assert any(v in message for v in ("float32", "dynamic"))  # lists valid choices


def test_unknown_dtype_keeps_jmp_message():
    with pytest.raises(ValueError, match="Unknown dtype"):
        jmp_policy.get_policy("p=f32,c=potato")


@pytest.mark.parametrize("args, exc, match", [
    ((jnp.int32,), ValueError, "param_dtype must be a floating dtype"),
    ((jnp.float32, jnp.int8), ValueError, "compute_dtype must be a floating dtype"),
    ((jnp.float32, jnp.float16, jnp.complex64), ValueError, "output_dtype must be a floating"),
    ((object(),), TypeError, "Expected a dtype"),
    (("mixed_float16", jnp.float16), ValueError, "Unknown dtype 'mixed_float16'"),
    (("p=f32,c=f16", jnp.float16), TypeError, "takes a name alone"),
])
def test_bad_constructor_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        Policy(*args)


@pytest.mark.parametrize("wrap, match", [
    (lambda: Policy("mixed_float16").wrap(123), "Policy.wrap\\(fn\\) takes a function"),
    (lambda: jmp_policy.wrap(Policy("float32")), "the function comes first"),
    (lambda: jmp_policy.wrap(Policy("float32"), lambda x: x), "the function comes first"),
    (lambda: Policy("float32").wrap(Policy("float16")), "the function comes first"),
    (lambda: jmp_policy.wrap("mixed_float16"), "takes a function"),
    (lambda: jmp_policy.PolicyMap({}).wrap(None), "PolicyMap.wrap\\(fn\\) takes a function"),
])
def test_wrap_rejects_what_cannot_be_called_when_wrapping(wrap, match):
    with pytest.raises(TypeError, match=match):
        wrap()


def test_wrong_types_as_policy():
    with pytest.raises(TypeError, match="Expected a Policy, a policy name"):
        jmp_policy.set_global_policy(3)
    with pytest.raises(TypeError, match="Expected a Policy, a policy name"):
        jmp_policy.wrap(lambda x: x, policy=jnp.float16)
    with pytest.raises(TypeError, match="get_policy expects a policy name"):
        jmp_policy.get_policy(None)
    with pytest.raises(TypeError, match="Expected a Policy"):
        with jmp_policy.policy_scope(1.0):
            pass


# ---------------------------------------------------------------------------
# Deprecated infer forms
# ---------------------------------------------------------------------------
def test_infer_policies_warn_and_infer_at_call_time():
    with pytest.warns(DeprecationWarning, match="deprecated") as record:
        infer = Policy("infer")
    assert record[0].filename == __file__  # points at the caller's line
    with pytest.warns(DeprecationWarning):
        infer32 = Policy("infer_float32_vars")
    with pytest.warns(DeprecationWarning):
        assert Policy("infer_with_float32_vars") == infer32
    assert dtypes(infer) == (None, None, None)
    assert dtypes(infer32) == (F32, None, None)
    assert infer.name == "infer" and infer32.name == "infer_float32_vars"

    def f(w, x):
        return w * x, w.dtype, x.dtype

    w = jnp.ones(3, jnp.float32)
    x16 = jnp.ones(3, jnp.bfloat16)
    out, wd, xd = infer32.wrap(f)(x16, w)  # first floating input is bfloat16
    assert (wd, xd, out.dtype) == (BF16, BF16, BF16)
    out, wd, xd = infer.wrap(f)(w, x16)  # first floating input is float32
    assert (wd, xd, out.dtype) == (F32, F32, F32)
    assert infer32.cast_to_param(x16).dtype == F32
    assert infer.cast_to_param(x16) is x16
    assert infer.cast_to_compute(x16) is x16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from_config must not re-warn the user
        assert Policy.from_config(infer32.get_config()) == infer32


# ---------------------------------------------------------------------------
# Casting
# ---------------------------------------------------------------------------
def test_casting_rules_on_mixed_tree():
    p = Policy("mixed_bfloat16")
    key = jax.random.key(0)
    raw_key = jax.random.PRNGKey(0)
    obj = object()
    tree = {
        "f32": jnp.ones(3), "f16": jnp.ones(3, jnp.float16), "np32": np.ones(2, np.float32),
        "npscalar": np.float32(2.0), "i32": jnp.arange(3), "bool": jnp.array([True]),
        "c64": jnp.ones(2, jnp.complex64), "key": key, "raw_key": raw_key, "py": 1.5, "int": 3,
        "s": "text", "none": None, "obj": obj, "bf16": jnp.ones(2, jnp.bfloat16),
    }
    out = p.cast_to_compute(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for k in ["f32", "f16", "np32", "npscalar"]:
        assert out[k].dtype == BF16, k
    assert isinstance(out["np32"], np.ndarray)  # numpy stays numpy
    for k in ["i32", "bool", "c64", "key", "raw_key", "py", "int", "s", "obj", "bf16"]:
        assert out[k] is tree[k], k  # untouched / already in target: same object
    assert out["none"] is None
    assert out["py"] == 1.5 and type(out["py"]) is float
    np.testing.assert_array_equal(np.asarray(out["f32"], np.float32), np.ones(3))


def test_cast_to_param_and_output_and_jmp_helpers():
    p = Policy("p=f32,c=f16,o=bf16")
    x = jnp.ones(2, jnp.float16)
    assert p.cast_to_param(x).dtype == F32
    assert p.cast_to_output(x).dtype == BF16
    assert p.cast_to_compute(x) is x
    assert jmp_policy.cast_to_full({"a": x})["a"].dtype == F32
    assert jmp_policy.cast_to_half({"a": jnp.ones(2)})["a"].dtype == HALF
    assert jmp_policy.half_dtype() == jnp.float16  # CPU: float16 (bfloat16 only on TPU)


def test_batched_eager_cast_matches_per_leaf_cast():
    # Many leaves go through one jitted convert; the result must equal astype per leaf.
    rng = np.random.default_rng(0)
    tree = [jnp.asarray(rng.standard_normal((i % 5 + 1, 3)) * 1e3, jnp.float32) for i in range(40)]
    tree += [jnp.arange(4), jnp.ones(2, jnp.float16)]
    out = Policy("bfloat16").cast_to_compute(tree)
    for x, y in zip(tree, out):
        if jnp.issubdtype(x.dtype, jnp.floating):
            assert y.dtype == BF16
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(jnp.bfloat16)))
        else:
            assert y is x


def test_cast_under_jit_and_as_static_or_normal_argument():
    p = Policy("mixed_float16")

    @jax.jit
    def as_normal(policy, x):
        return policy.cast_to_compute(x)

    f_static = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
    x = jnp.ones(3)
    assert as_normal(p, x).dtype == F16
    assert f_static(x, p).dtype == F16
    assert f_static(x, Policy("bfloat16")).dtype == BF16  # a different static value retraces
    closed = jax.jit(lambda x: p.cast_to_compute(x))
    assert closed(x).dtype == F16


class TestCastsWithAndWithoutJit(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_casts_and_wrap(self):
        p = Policy("p=f32,c=bf16,o=f16")
        tree = {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.arange(3), "h": jnp.ones(2, jnp.float16)}
        out = self.variant(p.cast_to_compute)(tree)
        chex.assert_trees_all_equal_dtypes(out, {"w": jnp.ones((2, 3), jnp.bfloat16), "n": tree["n"],
                                                 "h": jnp.ones(2, jnp.bfloat16)})
        chex.assert_trees_all_equal(out["w"].astype(jnp.float32), tree["w"])
        y = self.variant(p.wrap(lambda w, x: x @ w))(jnp.ones((3, 2)), jnp.ones((4, 3)))
        chex.assert_type(y, jnp.float16)
        chex.assert_shape(y, (4, 2))
        chex.assert_trees_all_equal(y, jnp.full((4, 2), 3.0, jnp.float16))


def test_jit_adds_exactly_the_hand_written_converts():
    p = Policy("p=f32,c=bf16,o=f32")

    def f(w, x):
        return jnp.tanh(x @ w)

    def hand(w, x):
        return jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    ours = jax.make_jaxpr(p.wrap(f))(w, x)
    theirs = jax.make_jaxpr(hand)(w, x)
    prims = lambda j: [e.primitive.name for e in j.jaxpr.eqns]
    assert prims(ours) == prims(theirs)
    assert prims(ours).count("convert_element_type") == 3


def test_grad_and_vmap_through_wrap():
    p = Policy("mixed_bfloat16")

    def model(params, x):
        return jnp.sum(jnp.tanh(x @ params["w"]) + params["b"], axis=-1)

    params = {"w": jnp.full((3, 2), 0.5), "b": jnp.zeros(2)}
    x = jnp.ones((5, 3))
    f = p.wrap(model)
    assert f(params, x).dtype == BF16
    grads = jax.grad(lambda prm: f(prm, x).astype(jnp.float32).sum())(params)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))
    ref = jax.grad(lambda prm: model(prm, x).sum())(params)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=2e-2)
    vmapped = jax.vmap(f, in_axes=(None, 0))(params, x[:, None, :])
    assert vmapped.shape == (5, 1) and vmapped.dtype == BF16
    jitted = jax.jit(jax.grad(lambda prm: f(prm, x).astype(jnp.float32).sum()))(params)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(jnp.allclose, jitted, grads))


def test_wrap_kwargs_and_non_float_args():
    p = Policy("float16")

    def fn(x, *, scale, n, rng, name):
        assert x.dtype == F16 and scale.dtype == F16 and n.dtype == jnp.int32
        assert name == "hello"
        return {"y": x * scale, "n": n, "k": rng}

    key = jax.random.key(1)
    out = p.wrap(fn)(jnp.ones(2), scale=jnp.ones(2), n=jnp.arange(2), rng=key, name="hello")
    assert out["y"].dtype == F16 and out["n"].dtype == jnp.int32 and out["k"] is key
    assert p.wrap(fn).__name__ == "fn"


def test_wrap_on_flax_linen_apply():
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    x = jnp.ones((4, 3))
    variables = model.init(jax.random.key(0), x)
    p = Policy("mixed_bfloat16")
    y = p.wrap(model.apply)(variables, x)
    assert y.dtype == BF16
    np.testing.assert_allclose(np.asarray(y, np.float32), model.apply(variables, x), rtol=3e-2, atol=3e-2)
    grads = jax.grad(lambda v: p.wrap(model.apply)(v, x).astype(jnp.float32).sum())(variables)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))


def test_module_level_wrap_uses_global_policy_at_wrap_time():
    f = lambda x: x
    with jmp_policy.policy_scope("bfloat16"):
        wrapped = jmp_policy.wrap(f)
    assert wrapped(jnp.ones(2)).dtype == BF16  # scope has ended, but the policy was fixed
    assert jmp_policy.wrap(f, "float16")(jnp.ones(2)).dtype == F16
    assert jmp_policy.wrap(f)(jnp.ones(2, jnp.float16)).dtype == F32  # global default float32


# ---------------------------------------------------------------------------
# Global policy and scopes
# ---------------------------------------------------------------------------
@pytest.fixture
def restore_global_policy():
    before = jmp_policy.global_policy()
    yield
    jmp_policy.set_global_policy(before)


def test_global_policy_default_and_aliases(restore_global_policy):
    assert jmp_policy.global_policy() == Policy("float32")
    assert Policy() == Policy("float32")
    for setter in (jmp_policy.set_global_policy, jmp_policy.set_policy, jmp_policy.set_dtype_policy):
        setter("mixed_bfloat16")
        assert jmp_policy.global_policy() == jmp_policy.dtype_policy() == Policy("mixed_bfloat16")
        assert Policy() == Policy("mixed_bfloat16")
        setter(None)
        assert jmp_policy.global_policy() == Policy("float32")
    jmp_policy.set_global_policy(Policy("float16"))
    assert jmp_policy.dtype_policy() == Policy("float16")


def test_policy_scope_restores_on_exit_and_error(restore_global_policy):
    jmp_policy.set_global_policy("mixed_float16")
    with jmp_policy.policy_scope("bfloat16") as p:
        assert p == Policy("bfloat16") == Policy() == jmp_policy.global_policy()
        with jmp_policy.policy_scope(Policy("float64")):
            assert jmp_policy.global_policy() == Policy("float64")
        assert jmp_policy.global_policy() == Policy("bfloat16")
    assert jmp_policy.global_policy() == Policy("mixed_float16")
    with pytest.raises(RuntimeError):
        with jmp_policy.policy_scope("bfloat16"):
            raise RuntimeError("boom")
    assert jmp_policy.global_policy() == Policy("mixed_float16")


def test_policy_scope_is_thread_local_and_global_is_process_wide(restore_global_policy):
    barrier = threading.Barrier(2, timeout=10)
    seen = {}

    def worker(name, policy):
        with jmp_policy.policy_scope(policy):
            barrier.wait()  # both scopes are open at the same time
            seen[name] = (jmp_policy.global_policy(), Policy(),
                          jmp_policy.wrap(lambda x: x)(jnp.ones(1)).dtype)
            barrier.wait()
        seen[name + "_after"] = jmp_policy.global_policy()

    threads = [threading.Thread(target=worker, args=("a", "bfloat16")),
               threading.Thread(target=worker, args=("b", "float16"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] == (Policy("bfloat16"), Policy("bfloat16"), BF16)
    assert seen["b"] == (Policy("float16"), Policy("float16"), F16)
    assert seen["a_after"] == seen["b_after"] == Policy("float32")
    assert jmp_policy.global_policy() == Policy("float32")

    # set_global_policy in one thread is seen by another.
    t = threading.Thread(target=jmp_policy.set_global_policy, args=("mixed_bfloat16",))
    t.start()
    t.join()
    assert jmp_policy.global_policy() == Policy("mixed_bfloat16")


# ---------------------------------------------------------------------------
# Property-based tests
# ---------------------------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

_DTYPE_NAMES = {"float32": ["float32", "f32", "full"], "float16": ["float16", "f16"],
                "bfloat16": ["bfloat16", "bf16"], "float64": ["float64", "f64"]}
_KEY_FORMS = {"params": ["params", "p"], "compute": ["compute", "c"], "output": ["output", "o"]}


@st.composite
def policy_names(draw):
    """Random names in the key=value grammar, with the dtypes they must produce."""
    roles = draw(st.lists(st.sampled_from(["params", "compute", "output"]),
                          min_size=1, max_size=3, unique=True))
    chosen = {r: draw(st.sampled_from(sorted(_DTYPE_NAMES))) for r in roles}
    parts = [f"{draw(st.sampled_from(_KEY_FORMS[r]))}={draw(st.sampled_from(_DTYPE_NAMES[chosen[r]]))}"
             for r in roles]
    params = chosen.get("params", "float32")
    compute = chosen.get("compute", params)
    output = chosen.get("output", compute)
    return ",".join(parts), tuple(np.dtype(d) for d in (params, compute, output))


@settings(max_examples=150, deadline=None)
@given(policy_names())
def test_property_name_grammar_and_round_trips(case):
    name, expected = case
    p = Policy(name)
    assert dtypes(p) == expected
    assert Policy(str(p)) == p
    assert Policy(p.name) == Policy(*expected)
    assert Policy.from_config(p.get_config()) == p
    assert hash(Policy(str(p))) == hash(p)
    assert repr(p) == f'<Policy "{p}">'


_FLOAT = ["float32", "float16", "bfloat16", "float64"]
_OTHER = ["int32", "int8", "uint8", "bool", "complex64"]


@st.composite
def leaves(draw):
    kind = draw(st.sampled_from(["jax", "numpy", "npscalar", "other_dtype", "py", "none", "str", "key"]))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    if kind == "jax":
        return jnp.zeros(shape, draw(st.sampled_from(_FLOAT[:3])))
    if kind == "numpy":
        return np.zeros(shape, np.dtype(draw(st.sampled_from(_FLOAT))))
    if kind == "npscalar":
        return np.dtype(draw(st.sampled_from(_FLOAT))).type(1.5)
    if kind == "other_dtype":
        return jnp.zeros(shape, draw(st.sampled_from(_OTHER)))
    if kind == "py":
        return draw(st.sampled_from([1, 2.5, True, 1j]))
    if kind == "str":
        return draw(st.text(max_size=3))
    if kind == "key":
        return jax.random.key(draw(st.integers(0, 5)))
    return None


trees = st.recursive(
    leaves(),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3)),
    max_leaves=12)


@settings(max_examples=120, deadline=None)
@given(trees, st.sampled_from(_FLOAT[:3]), st.sampled_from(["param", "compute", "output"]))
def test_property_only_floating_arrays_are_cast(tree, dtype, which):
    # (float64 is not a target here: without jax_enable_x64 JAX itself turns it into float32.)
    p = Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype)
    out = getattr(p, f"cast_to_{which}")(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for before, after in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(out)):
        is_array = isinstance(before, (jax.Array, np.ndarray, np.generic))
        floating = is_array and jnp.issubdtype(before.dtype, jnp.floating)
        if floating and before.dtype != np.dtype(dtype):
            assert after.dtype == np.dtype(dtype)
            assert np.shape(after) == np.shape(before)
            assert type(after) is type(before) or isinstance(before, jax.Array) == isinstance(after, jax.Array)
        else:
            assert after is before


# ---------------------------------------------------------------------------
# Shardings (8 simulated CPU devices, in a subprocess so the flag applies)
# ---------------------------------------------------------------------------
_SHARDING_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jmp_policy
assert jax.device_count() == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
shardings = [NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P(None, "model")),
             NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))]
tree = [jax.device_put(jnp.arange(64.0).reshape(8, 8) + i, s) for i, s in enumerate(shardings)] * 2
policy = jmp_policy.Policy("mixed_bfloat16")
eager = policy.cast_to_compute(tree)  # batched eager path
jitted = jax.jit(policy.cast_to_compute)(tree)
wrapped = jax.jit(policy.with_output_dtype("bfloat16").wrap(lambda t: t))(tree)
for x, e, j, w in zip(tree, eager, jitted, wrapped):
    assert e.dtype == j.dtype == w.dtype == jnp.bfloat16
    for y in (e, j, w):
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (y.sharding, x.sharding)
    np.testing.assert_array_equal(np.asarray(e, np.float32), np.asarray(x))
print("OK")
"""


@pytest.mark.slow  # a system test: a child interpreter on 8 devices
def test_casts_preserve_shardings_on_8_devices():
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDING_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


# ---------------------------------------------------------------------------
# The loss_scale keyword (part of a policy's value)
# ---------------------------------------------------------------------------
def test_default_loss_scale_dynamic_only_for_float16():
    ls = Policy("mixed_float16").loss_scale
    assert isinstance(ls, jmp_policy.DynamicLossScale)
    assert float(ls.loss_scale) == 2.0**15 and ls.period == 2000 and ls.factor == 2
    assert isinstance(Policy("float16").loss_scale, jmp_policy.DynamicLossScale)
    assert isinstance(Policy("p=f32,c=f16,o=f32").loss_scale, jmp_policy.DynamicLossScale)
    for name in ["float32", "mixed_bfloat16", "bfloat16", "p=f16,c=f32"]:
        assert isinstance(Policy(name).loss_scale, jmp_policy.NoOpLossScale), name


def test_loss_scale_is_part_of_the_value():
    default = Policy("mixed_float16")
    assert default == Policy("mixed_float16", loss_scale="dynamic")
    assert default == Policy("mixed_float16", loss_scale=jmp_policy.DynamicLossScale())
    assert default == Policy("mixed_float16", loss_scale=jmp_policy.DynamicLossScale(np.float16(2**15)))
    none = Policy("mixed_float16", loss_scale=None)
    assert none != default and hash(none) != hash(default)
    assert none == Policy("mixed_float16", loss_scale=jmp_policy.NoOpLossScale())
    assert isinstance(none.loss_scale, jmp_policy.NoOpLossScale)
    static = Policy("mixed_bfloat16", loss_scale=1024.0)
    assert isinstance(static.loss_scale, jmp_policy.StaticLossScale)
    assert float(static.loss_scale.loss_scale) == 1024.0
    assert static == Policy("mixed_bfloat16", loss_scale=jmp_policy.StaticLossScale(1024.0))
    assert Policy("float32", loss_scale="dynamic") != Policy("float32")


@pytest.mark.parametrize("policy", [
    Policy("mixed_float16", loss_scale=None),
    Policy("mixed_bfloat16", loss_scale="dynamic"),
    Policy("float32", loss_scale=0.5),
    Policy("mixed_float16", loss_scale=jmp_policy.DynamicLossScale(
        2.0**10, period=10, factor=3, min_loss_scale=2.0, max_loss_scale=2.0**20)),
    Policy("mixed_float16", loss_scale=jmp_policy.DynamicLossScale(period=7, factor=1.5)),
])
def test_loss_scale_round_trips_through_name_and_config(policy):
    assert Policy(str(policy)) == policy
    assert Policy.from_config(policy.get_config()) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert repr(policy).startswith(f'<Policy "{policy.name},loss_scale=')
    ls = policy.loss_scale
    again = Policy(policy.name, loss_scale=ls)
    assert again == policy


def test_dynamic_settings_survive_in_the_policy():
    ls = Policy("mixed_float16", loss_scale=jmp_policy.DynamicLossScale(
        2.0**10, period=10, factor=3, min_loss_scale=2.0, max_loss_scale=2.0**20)).loss_scale
    assert (float(ls.loss_scale), ls.period, ls.factor, float(ls.min_loss_scale),
            float(ls.max_loss_scale)) == (1024.0, 10, 3, 2.0, 2.0**20)


def test_bad_loss_scale_arguments():
    with pytest.raises(ValueError, match="Unknown loss_scale 'static'"):
        Policy("float32", loss_scale="static")
    with pytest.raises(ValueError, match="loss_scale"):
        Policy("float32", loss_scale=-1.0)
    with pytest.raises(TypeError, match="loss_scale must be"):
        Policy("float32", loss_scale=[1.0])
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        p = Policy("float32", loss_scale=8)
    assert p == Policy("float32", loss_scale=8.0)

    @jax.jit
    def build(x):
        return Policy("float32", loss_scale=jmp_policy.StaticLossScale(x)).name

    with pytest.raises(TypeError, match="traced value"):
        build(jnp.float32(2.0))


@pytest.mark.slow  # a system test: a fresh child interpreter
def test_import_does_not_initialise_jax_backends():
    # Users configure JAX (jax.distributed.initialize, device counts, platforms)
    # after their imports; an import that ran a JAX operation would forbid it.
    import os
    import subprocess
    import sys

    script = ("import jmp_policy, jax\n"
              "jax.config.update('jax_num_cpu_devices', 3)\n"
              "assert jax.device_count() == 3, jax.devices()\n"
              "print('OK')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                               "JAX_PLATFORMS": "cpu"})  # CPU devices, also on a GPU machine
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
