"""Optimizer states, loss scaling and mixture-of-experts products on sharded arrays.

A train step as a user writes it (``jit`` around ``value_and_grad``, the optimizer's
``update`` and ``optax.apply_updates``) on a mesh of 8 simulated CPU devices, with
explicit axes (``jax.set_mesh``: JAX checks shardings while tracing) and with automatic
axes (XLA's partitioner places arrays). The MLP's layers are sharded the three usual
ways: data-parallel (replicated), tensor-parallel (over ``model``) and FSDP (over
``data``, gathered for use); the batch over ``data``. Four copies of it train at once
through ``optax.multi_transform``, one per feature: `quantize_state` in 8 and 4 bits,
`cast_state`, and `low_precision_params` on a bfloat16 copy, all inside
`loss_scaling`, whose second step meets a non-finite gradient.

Each step's optimizer gives, bit for bit, what it gives on one device from the same
inputs; the gradients differ from one device's by their summation order only. The
state is sharded like the parameters and stays so. The compiled step has the
collectives of plain Adam without loss scaling, and a few counted ones of a few bytes.

Then ``lax.ragged_dot`` under autocast with every float8 recipe, its tokens sharded.
Under explicit axes JAX itself runs a ragged product only inside
``jax.sharding.auto_axes`` (``lax.ragged_dot`` infers no output sharding, and with
the tokens sharded its ``out_sharding`` form fails in its backward pass and in
XLA:CPU's expansion), so that is the form tested there; autocast's products must run
wherever plain JAX's do.

Everything runs in one subprocess (tests/support/sharded_training_worker.py), which reports
facts; the checks are here.
"""

from __future__ import annotations

import pytest

from support.sharded_hlo import SUPPORT, shared_run

pytestmark = pytest.mark.slow  # a system test: a child interpreter on 8 devices

MODES = ("explicit", "auto")
FEATURES = ("q8", "q4", "cast", "lp")
RECIPES = ("none", "tensorwise", "rowwise", "mxfp8", "nvfp4")


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    return shared_run(tmp_path_factory, "sharded_training",
                      [SUPPORT / "sharded_training_worker.py"])


@pytest.fixture(scope="module")
def training(facts):
    assert facts["devices"] == 8
    runs = facts["training"]
    assert "crashed" not in runs, runs["crashed"]
    crashed = {mode: run["crashed"] for mode, run in runs.items() if "crashed" in run}
    assert not crashed
    return runs


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("mode", MODES)
def test_each_step_of_the_optimizers_is_one_devices_bit_for_bit(training, mode):
    steps = training[mode]["steps"]
    # Every leaf of the new parameters and state (codes, exponents, keys, Kahan
    # buffers, bfloat16 moments, the loss scale and counters) as one device makes it
    # from the same parameters, state and gradients.
    assert [s["optimizer_differs"] for s in steps] == [[]] * 3
    # ...and the steps did something (a comparison of unchanged arrays proves nothing).
    assert [s["unchanged"] for s in steps] == [False, True, False]


@pytest.mark.parametrize("mode", MODES)
def test_gradients_and_loss_are_one_devices_up_to_summation_order(training, mode):
    first = training[mode]["steps"][0]
    # Float32 gradients summed over the batch's shards in another order; the bfloat16
    # copy's gradients are bfloat16, whose partial sums round to 8 bits.
    bounds = {"q8": 1e-5, "q4": 1e-5, "cast": 1e-5, "lp": 1e-2}
    assert all(first["grad_error"][f] <= bounds[f] for f in FEATURES), first["grad_error"]
    assert first["loss_error"] <= 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_gradient_on_one_shard_skips_the_step_everywhere(training, mode):
    steps = training[mode]["steps"]
    assert [s["grads_finite"] for s in steps] == [True, False, True]
    assert [s["skipped_steps"] for s in steps] == [0, 1, 1]
    # From 1024: doubled by each finite step (period=1), halved by the skipped one.
    assert [s["loss_scale"] for s in steps] == [2048.0, 1024.0, 2048.0]
    assert all(s["params_finite"] for s in steps)


@pytest.mark.parametrize("mode", MODES)
def test_states_are_sharded_like_their_parameters_and_stay_so(training, mode):
    run = training[mode]
    # Moments, codes, Kahan buffers: as their parameter; block exponents too, but
    # replicated along the 8-bit FSDP weight's last axis, whose shards (32 values)
    # split its blocks (128); counts, keys, the loss scale and samples replicated.
    assert run["layout"] == []
    # The check sees a state that is not so (codes of a sharded weight replicated).
    assert len(run["layout_of_a_replicated_state"]) == 2
    # Every output keeps its input's sharding: the next step reuses the program.
    assert [s["shardings_changed"] for s in run["steps"]] == [[]] * 3


def _extra_collectives(run):
    step, plain = run["collectives"], run["plain_adam_collectives"]
    missing = {k: n - step.get(k, 0) for k, n in plain.items() if n > step.get(k, 0)}
    extra = {k: n - plain.get(k, 0) for k, n in step.items() if n > plain.get(k, 0)}
    return missing, extra


def _justified(key):
    """What an extra collective operand is for, where it is one of the expected kinds."""
    kind, reducer, operand = key.split(" ")
    if (kind, reducer) == ("all-reduce", "add") and operand == "f32[]":
        return "scalars"
    if (kind, reducer) == ("all-reduce", "add") and operand == "f32[16]":
        return "samples"  # low_precision_params' misuse check: 16 weights of a leaf
    if (kind, reducer) == ("all-reduce", "maximum") and operand.startswith("u8["):
        return "block maxima"  # quantize_state: a block's maximum over the shards it spans
    if kind == "all-gather" and operand.startswith(("u8[", "s32[")):
        return "block exponents"  # ...and its exponents, replicated along that axis
    return None


@pytest.mark.parametrize("mode", MODES)
def test_collectives_are_plain_adams_and_a_few_counted_bytes(training, mode):
    missing, extra = _extra_collectives(training[mode])
    # The HLO reader sees collectives: plain Adam's step gathers the FSDP weight.
    assert any(k.startswith("all-gather") for k in training[mode]["plain_adam_collectives"])
    assert missing == {}
    # Every gradient reduction and FSDP gather is plain Adam's; nothing moves a weight,
    # a moment or a gradient more.
    assert all(_justified(k) for k in extra), extra
    counted = {}
    for key, n in extra.items():
        counted[_justified(key)] = counted.get(_justified(key), 0) + n
    assert counted == {
        # The 8-bit FSDP weight (256, 128), its last axis in shards of 32: its moments'
        # blocks (128) span four shards; per moment, the blocks' maxima combined (a
        # byte per row and shard).
        "block maxima": 2,
        # low_precision_params: 16 weights of each sharded bfloat16 weight (3 of
        # them), before and after the step.
        "samples": 6,
        # loss_scaling's finiteness check sums x - x over the gradients: a partial sum
        # per group of sharded gradients (explicit axes: per shape, dtype and sharding,
        # 3 layouts in 2 dtypes; automatic axes: per gradient, 12 sharded), which XLA
        # adds to the gradients' own all-reduces; and low_precision_params' misuse
        # check, a host callback whose scalar result device 0 gives the others.
        "scalars": {"explicit": 6, "auto": 12}[mode] + 1,
    }


# --------------------------------------------------------------------------- #
# Ragged (mixture-of-experts) products.
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def ragged(facts):
    assert "crashed" not in facts["ragged"], facts["ragged"]
    return facts["ragged"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_sharded_ragged_products_are_one_devices(ragged, recipe, mode):
    run = ragged[mode][recipe]
    assert "crashed" not in run, run["crashed"]
    # Float8 and block products accumulate in float32: the experts' gradient, summed
    # over the tokens' shards, differs by its summation order. Plain bfloat16 rounds
    # those partial sums to bfloat16.
    assert run["error"] <= (2e-2 if recipe == "none" else 1e-5), run["error"]
    # Gradients sharded as their operands: tokens over "data", the experts replicated.
    assert run["shardings"] == [["data"], []]


@pytest.mark.parametrize("mode", MODES)
def test_ragged_collectives_are_bfloat16s_and_the_scales_maxima(ragged, mode):
    plain = ragged[mode]["none"]["collectives"]
    # The experts' gradient and the loss, summed over the tokens' shards.
    assert plain == {"all-reduce add f32[4,64,48]": 1, "all-reduce add f32[]": 1}
    amax = {}
    for recipe in RECIPES[1:]:
        got = dict(ragged[mode][recipe]["collectives"])
        maxima = {k: got.pop(k) for k in list(got) if k.startswith("all-reduce maximum f32")}
        assert got == plain, (recipe, got)  # no seed hash (u32), no gather
        amax[recipe] = sum(maxima.values())
    # Maxima over the tokens' shards, by operand: tensorwise's two tensor scales (the
    # tokens forward, the incoming gradient backward); for the experts' gradient, which
    # sums over each expert's tokens, rowwise's per-expert columns of both operands,
    # MXFP8's blocks of 32 tokens (shards hold 16) of both, and NVFP4's blocks of 16
    # tokens of both and four per-expert tensor scales.
    assert amax == {"tensorwise": 2, "rowwise": 2, "mxfp8": 2, "nvfp4": 6}, amax


def test_ragged_products_run_under_explicit_axes_wherever_plain_jax_does(ragged):
    # lax.ragged_dot(..., out_sharding=...) under explicit axes: plain JAX (0.10) runs its
    # value on replicated tokens, but cannot differentiate it, nor expand it on XLA:CPU
    # with the tokens sharded. Autocast's products run wherever it does.
    runs = ragged["out_sharding"]
    assert runs["replicated value"]["plain"] == "ok"  # so that the check checks something
    for case, results in runs.items():
        if results["plain"] == "ok":
            assert all(results[r] == "ok" for r in RECIPES), (case, results)
