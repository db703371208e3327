"""Tests for jmp_policy.PolicyMap."""

import copy
import dataclasses
import pickle
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy
from jmp_policy import Policy, PolicyMap

F16, BF16, F32 = np.dtype("float16"), np.dtype("bfloat16"), np.dtype("float32")


def flax_like_params():
    return {"params": {
        "Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
        "LayerNorm_0": {"scale": jnp.ones(4), "bias": jnp.zeros(4)},
        "Embed_0": {"embedding": jnp.ones((10, 4))},
        "step": jnp.array(3),
    }}


def dtypes_of(tree):
    return jax.tree_util.tree_map(lambda x: x.dtype, tree)


def test_first_matching_rule_wins_else_default():
    pm = PolicyMap([("LayerNorm", "float32"), ("LayerNorm_0/scale", "float16"), ("Embed", "bf16")],
                   default="mixed_float16")
    assert pm.policy_for("params/LayerNorm_0/scale") == Policy("float32")  # first rule wins
    assert pm.policy_for("params/Embed_0/embedding") == Policy("bfloat16")
    assert pm.policy_for("params/Dense_0/kernel") == Policy("mixed_float16")
    out = dtypes_of(pm.cast_to_compute(flax_like_params()))["params"]
    assert out["Dense_0"] == {"kernel": F16, "bias": F16}
    assert out["LayerNorm_0"] == {"scale": F32, "bias": F32}
    assert out["Embed_0"]["embedding"] == BF16
    assert out["step"] == jnp.int32  # non-floating untouched


def test_rules_as_mapping_and_paths_as_key_paths():
    pm = PolicyMap({r"bias$": Policy("float32")}, default=Policy("bfloat16"))
    params = flax_like_params()
    path_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, _ in path_leaves:
        text = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        assert pm.policy_for(path) == pm.policy_for(text)
    assert pm.policy_for("params/Dense_0/bias") == Policy("float32")
    # list indices and attribute names are part of paths too
    tree = [{"w": jnp.ones(2)}, (jnp.ones(2),)]
    pm2 = PolicyMap([(r"^0/w$", "float16"), (r"^1/0$", "bfloat16")], default="float32")
    out = pm2.cast_to_compute(tree)
    assert out[0]["w"].dtype == F16 and out[1][0].dtype == BF16


def test_param_output_casts_per_leaf():
    pm = PolicyMap({"LayerNorm": "float32"}, default="p=f16,c=bf16,o=f32")
    params = flax_like_params()
    p = dtypes_of(pm.cast_to_param(params))["params"]
    o = dtypes_of(pm.cast_to_output(params))["params"]
    assert p["Dense_0"]["kernel"] == F16 and p["LayerNorm_0"]["scale"] == F32
    assert o["Dense_0"]["kernel"] == F32 and o["LayerNorm_0"]["scale"] == F32


def test_same_object_returned_when_no_cast_needed():
    pm = PolicyMap({"LayerNorm": "float32"}, default="float32")
    params = flax_like_params()
    out = pm.cast_to_compute(params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(out)):
        assert a is b


def test_default_none_is_global_policy_at_construction():
    with jmp_policy.policy_scope("bfloat16"):
        pm = PolicyMap({})
    assert pm.default == Policy("bfloat16")
    assert PolicyMap({}).default == Policy("float32")


def test_wrap_casts_first_arg_by_path_rest_by_default():
    pm = PolicyMap({"LayerNorm": "float32"}, default="mixed_bfloat16")
    seen = {}

    def apply(params, x, *, y):
        seen.update(ln=params["params"]["LayerNorm_0"]["scale"].dtype,
                    dense=params["params"]["Dense_0"]["kernel"].dtype, x=x.dtype, y=y.dtype)
        return x @ params["params"]["Dense_0"]["kernel"]

    out = pm.wrap(apply)(flax_like_params(), jnp.ones((2, 3)), y=jnp.ones(1))
    assert seen == {"ln": F32, "dense": BF16, "x": BF16, "y": BF16}
    assert out.dtype == BF16
    grads = jax.grad(lambda p: pm.wrap(apply)(p, jnp.ones((2, 3)), y=jnp.ones(1)).sum()
                     .astype(jnp.float32), allow_int=True)(flax_like_params())
    assert grads["params"]["Dense_0"]["kernel"].dtype == F32


def test_policy_map_under_jit_static_and_hashable():
    pm = PolicyMap({"bias": "float16"}, default="float32")
    assert pm == PolicyMap({"bias": Policy("float16")}, default=Policy("float32"))
    assert hash(pm) == hash(PolicyMap([("bias", "float16")], default="float32"))
    assert jax.tree_util.tree_leaves(pm) == []
    f = jax.jit(lambda m, t: m.cast_to_compute(t), static_argnums=0)
    out = f(pm, {"bias": jnp.ones(2), "kernel": jnp.ones(2)})
    assert out["bias"].dtype == F16 and out["kernel"].dtype == F32
    assert "bias" in repr(pm)


@pytest.mark.parametrize("rules, exc, match", [
    ({"(unclosed": "float32"}, ValueError, r"rule #0: '\(unclosed' is not a valid regular expression"),
    ([("ok", "float32"), ("[a-", "float16")], ValueError, "rule #1"),
    ({"x": "float33"}, ValueError, "Unknown dtype 'float33'"),
    ({"x": 3}, TypeError, "Expected a Policy, a policy name"),
    ([("x",)], TypeError, r"must be a \(regex, policy\) pair"),
    ([(3, "float32")], TypeError, "pattern must be a regex string"),
    ("LayerNorm", TypeError, "mapping or a sequence"),
])
def test_bad_rules(rules, exc, match):
    with pytest.raises(exc, match=match):
        PolicyMap(rules, default="float32")


def test_bad_default():
    with pytest.raises(TypeError, match="Expected a Policy"):
        PolicyMap({}, default=1.0)


# ---------------------------------------------------------------------------
# Rules that match nothing
# ---------------------------------------------------------------------------
def test_rule_that_matches_no_leaf_warns_naming_it_once_per_tree_structure():
    pm = PolicyMap({"LayerNrom": "float32", "Dense": "bfloat16"}, default="float32")
    params = flax_like_params()
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match=r"rule #0 \('LayerNrom'\)") as record:
        out = pm.cast_to_compute(params)
    assert len(record) == 1  # "Dense" matched
    assert "params/Dense_0/kernel" in str(record[0].message)  # shows what paths look like
    assert record[0].filename == __file__
    assert out["params"]["LayerNorm_0"]["scale"].dtype == F32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same structure again (a training step): no repeat
        pm.cast_to_param(params)
        pm.cast_to_output(jax.tree_util.tree_map(lambda x: x + 1, params))
        pm.cast_to_compute({})  # nothing to match
        jax.jit(pm.cast_to_compute)(params)
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match="LayerNrom"):
        pm.wrap(lambda p, x: x)({"Dense_0": jnp.ones(2)}, jnp.ones(2))  # another structure
    with pytest.warns(jmp_policy.UnmatchedRuleWarning, match="LayerNrom"):
        jax.jit(PolicyMap({"LayerNrom": "float32"}).cast_to_compute)(params)  # at trace time
    assert issubclass(jmp_policy.UnmatchedRuleWarning, UserWarning)


def test_policy_map_is_a_frozen_picklable_value():
    pm = PolicyMap([("LayerNorm", "float32"), ("bias$", "float16")], default="mixed_bfloat16")
    pm.cast_to_compute(flax_like_params())  # fills its cache, which is not part of the value
    with pytest.raises(dataclasses.FrozenInstanceError):
        pm.default = Policy("float32")  # type: ignore[misc]
    assert pm.rules == (("LayerNorm", Policy("float32")), ("bias$", Policy("float16")))
    for again in (pickle.loads(pickle.dumps(pm)), copy.deepcopy(pm)):
        assert again == pm and hash(again) == hash(pm)
        chex.assert_trees_all_equal_dtypes(again.cast_to_compute(flax_like_params()),
                                           pm.cast_to_compute(flax_like_params()))
