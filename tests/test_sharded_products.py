"""Autocast's float8 and block-scaled products on sharded operands.

Every recipe, under a mesh of explicit axes (``jax.set_mesh``, where JAX checks
shardings while tracing) and of auto axes (where XLA's partitioner places arrays),
with data-parallel, FSDP-style and tensor-parallel shardings: ``jit(grad)`` runs,
gives the single-device gradients (to float32 summation order), shards them as
plain bfloat16 does, and adds no collectives to bfloat16's beyond the float8 scales'
absolute maxima. All cases run in one subprocess on 8 simulated CPU devices.
"""

import json

import pytest

from support.sharded_hlo import shared_run

pytestmark = pytest.mark.slow  # a system test: a child interpreter on 8 devices

# "nvfp4 parts": NVFP4 with its Hadamard transform and 16 x 16 weight tiles.
RECIPES = ("none", "tensorwise", "rowwise", "mxfp8", "nvfp4", "nvfp4 parts")
MODES = ("explicit", "auto")
SHARDINGS = ("dp", "fsdp", "tp")

_SCRIPT = r'''
import json, re, sys, traceback
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jmp_policy

RECIPES, MODES, SHARDINGS = json.loads(sys.argv[1])
f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
# tanh and its derivative in float32: sharded and single-device programs then differ by
# summation order only, not by where XLA fuses (and keeps excess precision in) bfloat16
# work, which float8 rounding of the gradient would magnify.
RULES = {"float32": ["tanh"]}
rng = np.random.RandomState(0)
w0 = jnp.asarray(rng.randn(256, 128).astype(np.float32) / 16)
x0 = jnp.asarray(rng.randn(128, 256).astype(np.float32))
# (w, x): batch-sharded x; FSDP: w sharded on its first axis, x on its batch; w on its output.
SPECS = {"dp": (P(), P("data")), "fsdp": (P("data"), P("data")), "tp": (P(None, "data"), P())}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def collectives(text):
    """Counts of each collective in optimized HLO; all-reduces of a maximum apart ("amax",
    with their operand count: XLA may combine several into one)."""
    bodies = dict(re.findall(r"\n(%\S+) [^\n]*\{\n(.*?)\n\}", text, re.S))
    counts = {}
    for line in text.splitlines():
        m = re.search(r"= (.+?) (" + "|".join(KINDS) + r")(-start)?\(", line)
        if not m:
            continue
        kind = m.group(2)
        apply = re.search(r"to_apply=(%[^,\s]+)", line)
        if kind == "all-reduce" and apply and "maximum(" in bodies.get(apply.group(1), ""):
            counts["amax"] = counts.get("amax", 0) + 1
            counts["amax operands"] = counts.get("amax operands", 0) + m.group(1).count("f32[")
            continue
        if kind == "all-reduce" and m.group(1).startswith(("u32", "(u32")):
            kind = "all-reduce u32"  # a hash (a seed), not a gradient
        counts[kind] = counts.get(kind, 0) + 1
    return counts


facts = {}
FP8 = {"none": None, "nvfp4 parts": jmp_policy.Float8Recipe("nvfp4", hadamard=True,
                                                              tiled_weights=True)}
for recipe in RECIPES:
    grad = jax.grad(jmp_policy.autocast(f, "mixed_bfloat16", rules=RULES,
                                        fp8=FP8.get(recipe, recipe)), argnums=(0, 1))
    single = [np.asarray(g) for g in jax.jit(grad)(w0, x0)]
    for mode in MODES:
        axis = AxisType.Explicit if mode == "explicit" else AxisType.Auto
        mesh = jax.make_mesh((4,), ("data",), axis_types=(axis,), devices=jax.devices()[:4])
        for name in SHARDINGS:
            key = f"{recipe} {mode} {name}"
            try:
                with jax.set_mesh(mesh):
                    w, x = (jax.device_put(a, NamedSharding(mesh, s))
                            for a, s in zip((w0, x0), SPECS[name]))
                    compiled = jax.jit(grad).lower(w, x).compile()
                    out = compiled(w, x)
                    step = None
                    if mode == "auto":  # an update ties the gradient to w's sharding
                        step = jax.jit(lambda w, x: w - 0.1 * grad(w, x)[0])(w, x)
                got = [np.asarray(g) for g in out]
                facts[key] = {
                    "ok": True,
                    "bit_equal": all(a.tobytes() == b.tobytes() for a, b in zip(got, single)),
                    "error": max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                                 for a, b in zip(got, single)),
                    "shardings": [str(g.sharding.spec) for g in out],
                    "step_sharding": None if step is None else str(step.sharding.spec),
                    "collectives": collectives(compiled.as_text()),
                }
            except Exception as e:
                facts[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
json.dump(facts, open(sys.argv[2], "w"), indent=1)
'''


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    script = tmp_path_factory.mktemp("sharded_products") / "sharded.py"
    script.write_text(_SCRIPT)
    return shared_run(tmp_path_factory, "sharded_products",
                      [script, json.dumps([RECIPES, MODES, SHARDINGS])])


def test_every_recipe_runs_under_every_mesh_and_sharding(facts):
    crashed = {k: v["error"] for k, v in facts.items() if not v["ok"]}
    assert not crashed


def test_sharded_gradients_are_the_single_device_ones(facts):
    # Plain bfloat16 and quantized GEMMs give bfloat16, and a partitioned product rounds
    # its partial sums to bfloat16 before adding them: a few units of bfloat16's
    # precision on the largest values (well within float8's own error; a wrong
    # partitioning, a sum missed or doubled, is off by far more).
    for key, v in facts.items():
        assert v["error"] <= 5e-2, (key, v["error"])


def test_gradients_are_sharded_as_plain_bfloat16_shards_them(facts):
    for recipe in RECIPES[1:]:
        for mode in MODES:
            for name in SHARDINGS:
                got, plain = facts[f"{recipe} {mode} {name}"], facts[f"none {mode} {name}"]
                if mode == "explicit":  # the gradients' types are the operands'
                    assert got["shardings"] == plain["shardings"], (recipe, mode, name)
                    continue
                # Auto axes: XLA's propagation may replicate an FSDP weight's gradient that
                # nothing ties to the weight (quantized along another axis than the forward's
                # operand); a training step's update ties it, and it comes out as the weight.
                assert got["step_sharding"] == plain["step_sharding"], (recipe, mode, name)
                if name != "fsdp":
                    assert got["shardings"] == plain["shardings"], (recipe, mode, name)


def test_data_parallel_collectives_are_bfloat16s_and_the_scales_maxima(facts):
    for mode in MODES:
        plain = facts[f"none {mode} dp"]["collectives"]
        assert "amax" not in plain
        for recipe in RECIPES[1:]:
            got = dict(facts[f"{recipe} {mode} dp"]["collectives"])
            got.pop("amax", None)
            amax = got.pop("amax operands", 0)
            assert got == plain, (recipe, mode, got, plain)  # no seed hash: no u32 all-reduce
            # Maxima over the batch-sharded x and g: tensorwise's and NVFP4's tensor scales
            # (NVFP4: x's kept from the forward, g's once per backward contraction, and
            # with the Hadamard transform those of x and g rotated for the weight gradient),
            # rowwise's columns for the weight gradient; MXFP8's blocks lie within shards.
            assert amax == {"tensorwise": 2, "rowwise": 2, "mxfp8": 0, "nvfp4": 3,
                            "nvfp4 parts": 4}[recipe], \
                (recipe, mode, amax)


_STOCHASTIC_SCRIPT = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jmp_policy
from jmp_policy.float8 import Float8Recipe

# tanh in bfloat16: XLA fuses its derivative differently in the sharded and the
# single-device programs, where it may keep the excess precision of bfloat16 work.
f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
rng = np.random.RandomState(0)
w0 = jnp.asarray((rng.randn(256, 128) / 16).astype(np.float32))
x0 = jnp.asarray(rng.randn(8, 64, 256).astype(np.float32))
# (w, x): x batch-sharded; w on its output; a batch of 8 rows a device, less than a block.
CASES = {"dp": (P(), P("data"), x0), "tp": (P(None, "data"), P(), x0),
         "split blocks": (P(), P("data"), x0[:4, :8])}
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
facts = {}
for scaling in ("nvfp4", "mxfp8"):
    recipe = Float8Recipe(scaling, stochastic_rounding=True)
    grad = jax.jit(jax.grad(jmp_policy.autocast(f, "mixed_bfloat16", fp8=recipe), argnums=(0, 1)))
    for name, (w_spec, x_spec, x) in CASES.items():
        single = [np.asarray(g, np.float32) for g in grad(w0, x)]
        with jax.set_mesh(mesh):
            sharded = grad(jax.device_put(w0, NamedSharding(mesh, w_spec)),
                           jax.device_put(x, NamedSharding(mesh, x_spec)))
        got = [np.asarray(g, np.float32) for g in sharded]
        facts[f"{scaling} {name}"] = {
            "bit_equal": [a.tobytes() == b.tobytes() for a, b in zip(got, single)],
            "error": [float(np.linalg.norm(a - b) / np.linalg.norm(b))
                      for a, b in zip(got, single)]}
json.dump(facts, open(sys.argv[1], "w"), indent=1)
'''


@pytest.fixture(scope="module")
def stochastic_facts(tmp_path_factory):
    script = tmp_path_factory.mktemp("sharded_stochastic") / "stochastic.py"
    script.write_text(_STOCHASTIC_SCRIPT)
    return shared_run(tmp_path_factory, "sharded_stochastic", [script])


def test_stochastic_rounding_is_the_single_devices_under_explicit_axes(stochastic_facts):
    # An element's random bits depend on its position in the whole array and its value,
    # and the quantizers read a bfloat16 gradient as bfloat16 holds it, whatever excess
    # precision the compiler kept in either program. A gradient whose product sums over
    # no sharded axis (w's in "tp", x's in "dp", both where blocks span shards and are
    # gathered) is the single device's bit for bit; one summed across shards differs by
    # the rounding of its bfloat16 partial sums (a few 2**-9), where independent
    # roundings would differ as much as either is from float32 (NVFP4: about 20%).
    for key, v in stochastic_facts.items():
        name = key.split(" ", 1)[1]
        exact = {"dp": [False, True], "tp": [True, False], "split blocks": [True, True]}[name]
        assert all(b for b, want in zip(v["bit_equal"], exact) if want), (key, v)
        assert max(v["error"]) < 1e-2, (key, v)
