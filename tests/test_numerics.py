"""Numerical quality on real data (scikit-learn's digits, CPU, fixed seeds).

The runs are those of ``examples/train_digits.py`` (imported, not copied), so
the README's figures and these assertions come from the same code.
"""

import importlib.util
import math
import os
import sys

import numpy as np
import pytest

import jmp_policy

pytestmark = pytest.mark.slow  # system tests: train_digits.py's training runs on real data

pytest.importorskip("flax")

_EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_digits.py")


def _load_example():
    spec = importlib.util.spec_from_file_location("train_digits", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (flax modules) look their module up
    spec.loader.exec_module(module)
    return module


td = _load_example()
LN10 = math.log(10.0)  # cross-entropy of a uniform guess over 10 classes


@pytest.fixture(scope="module")
def data():
    # scikit-learn is imported here, not while collecting (-m "not slow" collects this too).
    pytest.importorskip("sklearn")
    return td.load_data(seed=0)


@pytest.fixture(scope="module")
def float32_run(data):
    return td.train("float32", steps=250, seed=0, data=data)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_matches_float32_accuracy(policy, data, float32_run):
    run = td.train(policy, steps=250, seed=0, data=data)
    assert float32_run["test_accuracy"] > 0.95  # the comparison is with a model that learned
    assert abs(run["test_accuracy"] - float32_run["test_accuracy"]) <= 0.01, (
        policy, run["test_accuracy"], float32_run["test_accuracy"])
    assert run["skipped_steps"] == 0 and run["params_finite"]
    if policy == "mixed_float16":  # the policy's own default: dynamic loss scaling
        assert run["final_loss_scale"] == 2.0**15
    else:
        assert run["final_loss_scale"] == 1.0


def test_float16_underflow_without_loss_scaling_stalls_and_loss_scaling_fixes_it(data):
    # A loss weight of 1e-6 (as on an auxiliary loss) leaves Adam's updates
    # unchanged in exact arithmetic, but puts every float16 gradient below
    # float16's smallest subnormal (6e-8). 80 steps: the runs are step-bound, and the
    # scaled run has learned by then (at 80 and 120 steps alike: loss 0.13 and 0.09 of
    # ln 10, accuracy 0.89 and 0.93, as float32's) while the unscaled one has not moved.
    kw = dict(steps=80, seed=0, data=data, loss_weight=1e-6)
    f32 = td.train("float32", **kw)
    unscaled = td.train("mixed_float16", loss_scale=None, **kw)
    scaled = td.train("mixed_float16", **kw)  # the policy's dynamic loss scale

    # float16 without scaling: every gradient is flushed to zero, nothing moves.
    assert unscaled["zero_grad_fraction"] > 0.999
    assert f32["zero_grad_fraction"] < 0.5  # (ReLU and blank pixels give some exact zeros)
    assert unscaled["param_change"] == 0.0
    assert unscaled["final_loss"] > 0.99 * LN10
    assert unscaled["test_accuracy"] < 0.2
    # The same run with loss scaling learns like float32.
    assert scaled["zero_grad_fraction"] < f32["zero_grad_fraction"] + 0.1
    assert scaled["param_change"] > 1.0
    assert scaled["final_loss"] < 0.5 * LN10
    assert scaled["test_accuracy"] > 0.8
    assert abs(scaled["test_accuracy"] - f32["test_accuracy"]) <= 0.02


def test_too_large_initial_scale_is_backed_off_without_nan_in_params(data):
    initial = 2.0**30  # float16 gradients overflow to inf at this scale
    run = td.train("mixed_float16", steps=60, seed=0, data=data,
                   loss_scale=jmp_policy.DynamicLossScale(np.float32(initial)))
    scales = run["loss_scales"]
    # Each of the first steps overflows, is skipped, and halves the scale ...
    assert scales[:5] == [initial / 2**k for k in range(1, 6)]
    # ... until the gradients fit, within the first 16 steps.
    first_stable = next(i for i in range(1, len(scales)) if scales[i] == scales[i - 1])
    assert first_stable <= 16
    assert 5 <= run["skipped_steps"] < 30
    # No NaN/Inf ever reached the parameters (it would persist), and it learned.
    assert run["params_finite"]
    assert all(math.isfinite(l) for l in run["losses"])
    assert run["final_loss"] < 0.5 * LN10
