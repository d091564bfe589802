"""Server-side optimizers: hand-computed steps, MXNet's operation order, serialisation."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import hetps.optim as optim
from hetps.optim import DCASGD, SGD, Adam, Optimizer
from hetps.optim import registry as registry_mod


def f64(values):
    return np.array(values, dtype=np.float64)


def run_steps(opt, weight, grads, key=0):
    state = opt.create_state(key, weight)
    for g in grads:
        opt.update(key, weight, f64(g), state)
    return state


# ------------------------------------------------------------------------------- SGD
def test_sgd_plain_step_clips_before_adding_weight_decay():
    # g = clip(0.5 * [0.5, 4.0], 1) + 0.01 * w = [0.25, 1.0] + [0.01, -0.02] = [0.26, 0.98]
    # w -= 0.1 * g  ->  [0.974, -2.098]   (clip after wd would give -2.1 for the 2nd value)
    opt = SGD(learning_rate=0.1, wd=0.01, rescale_grad=0.5, clip_gradient=1.0)
    w = f64([1.0, -2.0])
    state = run_steps(opt, w, [[0.5, 4.0]])
    assert state is None
    np.testing.assert_allclose(w, [0.974, -2.098], rtol=0, atol=1e-15)


def test_sgd_momentum_two_steps_by_hand():
    # momentum 0.9, lr 0.1, wd 0.1, w0 = [1, -1]
    # step 1: g = [1, 0] + 0.1*[1, -1] = [1.1, -0.1];  mom = [-0.11, 0.01];  w = [0.89, -0.99]
    # step 2: g = [2, -1] + 0.1*[0.89, -0.99] = [2.089, -1.099]
    #         mom = 0.9*[-0.11, 0.01] - 0.1*g = [-0.3079, 0.1189];  w = [0.5821, -0.8711]
    opt = SGD(momentum=0.9, learning_rate=0.1, wd=0.1)
    w = f64([1.0, -1.0])
    state = run_steps(opt, w, [[1.0, 0.0], [2.0, -1.0]])
    np.testing.assert_allclose(state["mom"], [-0.3079, 0.1189], rtol=0, atol=1e-14)
    np.testing.assert_allclose(w, [0.5821, -0.8711], rtol=0, atol=1e-14)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("clip", [None, 0.3])
def test_sgd_matches_mxnet_kernel_formulas(momentum, clip):
    """MXNet's SGDKernel / SGDMomKernel written out on random data."""
    rng = np.random.default_rng(0)
    lr, wd, rescale = 0.05, 0.003, 0.25
    opt = SGD(momentum=momentum, learning_rate=lr, wd=wd, rescale_grad=rescale, clip_gradient=clip)
    w = rng.normal(size=(4, 5))
    ref_w = w.copy()
    ref_mom = np.zeros_like(w)
    state = opt.create_state("k", w)
    for _ in range(4):
        grad = rng.normal(size=w.shape) * 3
        g = rescale * grad if clip is None else np.clip(rescale * grad, -clip, clip)
        if momentum == 0.0:
            ref_w = (1 - lr * wd) * ref_w - lr * g
        else:
            ref_mom = momentum * ref_mom - lr * wd * ref_w - lr * g
            ref_w = ref_w + ref_mom
        opt.update("k", w, grad, state)
    np.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-14)


def test_sgd_without_clipping_when_clip_gradient_is_not_positive():
    for clip in (None, 0.0, -1.0):
        w = f64([0.0])
        run_steps(SGD(learning_rate=1.0, clip_gradient=clip), w, [[5.0]])
        assert w.tolist() == [-5.0]


# ------------------------------------------------------------------------------ Adam
def test_adam_two_steps_by_hand():
    # lr 0.1, betas (0.9, 0.999), w0 = 1, grads 0.5 then -1
    # t=1: lr_1 = 0.1*sqrt(0.001)/0.1; mean = 0.05; var = 0.00025
    #      w = 1 - lr_1 * 0.05 / (sqrt(0.00025) + 1e-8)
    # t=2: lr_2 = 0.1*sqrt(1 - 0.999**2)/(1 - 0.81); mean = 0.045 - 0.1 = -0.055
    #      var = 0.999*0.00025 + 0.001 = 0.00124975
    opt = Adam(learning_rate=0.1)
    w = f64([1.0])
    state = run_steps(opt, w, [[0.5]])
    lr1 = 0.1 * math.sqrt(0.001) / 0.1
    w1 = 1.0 - lr1 * 0.05 / (math.sqrt(0.00025) + 1e-8)
    assert state["t"] == 1
    np.testing.assert_allclose(state["mean"], [0.05], rtol=1e-12)
    np.testing.assert_allclose(state["var"], [0.00025], rtol=1e-12)
    np.testing.assert_allclose(w, [w1], rtol=1e-12)
    assert abs(w1 - 0.9) < 1e-6  # Adam's first step is ~lr in the gradient's direction

    opt.update(0, w, f64([-1.0]), state)
    lr2 = 0.1 * math.sqrt(1 - 0.999**2) / (1 - 0.9**2)
    w2 = w1 - lr2 * -0.055 / (math.sqrt(0.00124975) + 1e-8)
    assert state["t"] == 2
    np.testing.assert_allclose(state["mean"], [-0.055], rtol=1e-12)
    np.testing.assert_allclose(state["var"], [0.00124975], rtol=1e-12)
    np.testing.assert_allclose(w, [w2], rtol=1e-12)
    assert abs(w2 - 0.936610) < 1e-6


def test_adam_adds_weight_decay_before_clipping_like_mxnet():
    # MXNet's AdamUpdateKernel: g = clip(rescale*grad + wd*weight) = clip(0.9 + 0.2, 1) = 1.0
    # (clip(0.9) + 0.2 = 1.1 would be the SGD order)
    opt = Adam(learning_rate=0.1, wd=0.1, clip_gradient=1.0)
    w = f64([2.0])
    state = run_steps(opt, w, [[0.9]])
    np.testing.assert_allclose(state["mean"], [0.1], rtol=1e-12)
    np.testing.assert_allclose(state["var"], [0.001], rtol=1e-12)


def test_adam_step_count_is_per_key():
    opt = Adam(learning_rate=0.1)
    wa, wb = f64([1.0]), f64([1.0])
    sa, sb = opt.create_state(("a", 0), wa), opt.create_state(("b", 0), wb)
    for _ in range(3):
        opt.update(("a", 0), wa, f64([1.0]), sa)
    opt.update(("b", 0), wb, f64([1.0]), sb)
    assert (sa["t"], sb["t"]) == (3, 1)
    np.testing.assert_allclose(wb, [0.9], atol=1e-6)


def test_adam_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="beta1 must be in"):
        Adam(beta1=1.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        Adam(epsilon=0.0)


# ---------------------------------------------------------------------------- DCASGD
def test_dcasgd_per_worker_backup_by_hand():
    # lr 0.1, lamda 0.5, no momentum, w0 = 1
    opt = DCASGD(learning_rate=0.1, lamda=0.5)
    w = f64([1.0])
    state = opt.create_state(7, w)
    opt.on_pull(7, w, state, sender=1)  # backup[1] = 1.0
    # worker 2 has no backup: no compensation; d = 1 -> w = 0.9, backup[2] = 0.9
    opt.apply_update(7, w, f64([1.0]), state, sender=2)
    np.testing.assert_allclose(w, [0.9], rtol=1e-15)
    # worker 1: d = 2 + 0.5*2*2*(0.9 - 1.0) = 1.8 -> w = 0.72, backup[1] = 0.72
    opt.apply_update(7, w, f64([2.0]), state, sender=1)
    np.testing.assert_allclose(w, [0.72], rtol=1e-14)
    # worker 2 again, against its backup 0.9: d = 1 + 0.5*1*1*(0.72 - 0.9) = 0.91 -> 0.629
    opt.apply_update(7, w, f64([1.0]), state, sender=2)
    np.testing.assert_allclose(w, [0.629], rtol=1e-14)
    np.testing.assert_allclose(state["backup"][1], [0.72], rtol=1e-14)
    np.testing.assert_allclose(state["backup"][2], [0.629], rtol=1e-14)


def test_dcasgd_momentum_weight_decay_and_rescale_by_hand():
    # lr 0.1, lamda 0.5, momentum 0.5, wd 0.1, rescale 0.5, w0 = 1
    opt = DCASGD(learning_rate=0.1, lamda=0.5, momentum=0.5, wd=0.1, rescale_grad=0.5)
    w = f64([1.0])
    state = opt.create_state(0, w)
    opt.on_pull(0, w, state, sender=1)
    # worker 2, g = 1: d = 1 + 0.1*1 = 1.1; mom = -0.11; w = 0.89
    opt.apply_update(0, w, f64([2.0]), state, sender=2)
    np.testing.assert_allclose(w, [0.89], rtol=1e-14)
    # worker 1, g = 2, w_bak = 1: d = 2 + 0.089 + 0.5*4*(0.89 - 1) = 1.869
    # mom = 0.5*-0.11 - 0.1869 = -0.2419; w = 0.6481
    opt.apply_update(0, w, f64([4.0]), state, sender=1)
    np.testing.assert_allclose(state["mom"], [-0.2419], rtol=1e-13)
    np.testing.assert_allclose(w, [0.6481], rtol=1e-13)


def test_dcasgd_update_is_sender_zero_and_pull_copies():
    opt = DCASGD(learning_rate=0.1, lamda=1.0, clip_gradient=1.0)
    w = f64([1.0, 1.0])
    state = opt.create_state(0, w)
    opt.on_pull(0, w, state, sender=0)
    w[:] = [2.0, 2.0]  # the server's weight moves on; the backup must not follow
    np.testing.assert_array_equal(state["backup"][0], [1.0, 1.0])
    # g = clip([3, 0.5], 1) = [1, 0.5]; d = g + 1*g*g*(2 - 1) = [2, 0.75]; w -= 0.1*d
    opt.update(0, w, f64([3.0, 0.5]), state)
    np.testing.assert_allclose(w, [1.8, 1.925], rtol=1e-15)
    np.testing.assert_array_equal(state["backup"][0], w)
    assert not np.shares_memory(state["backup"][0], w)


# ------------------------------------------------------------ contract, dtypes, keys
@pytest.mark.parametrize(
    "opt",
    [SGD(learning_rate=0.1), SGD(learning_rate=0.1, momentum=0.9), Adam(), DCASGD(momentum=0.5)],
    ids=["sgd", "sgd-mom", "adam", "dcasgd"],
)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_updates_in_place_keeping_dtype_and_not_touching_grad(opt, dtype):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 4)).astype(dtype)
    alias = w.reshape(-1)  # a view: sees the update only if it happens in place
    before = alias.copy()
    grad = rng.normal(size=(3, 4)).astype(dtype)
    grad_before = grad.copy()
    state = opt.create_state((5, 1), w)
    opt.apply_update((5, 1), w, grad, state, sender=3)
    opt.on_pull((5, 1), w, state, sender=3)
    assert w.dtype == dtype
    assert not np.array_equal(alias, before)
    np.testing.assert_array_equal(grad, grad_before)

    # the same step computed in float64 agrees to the precision of the dtype
    ref = before.astype(np.float64).reshape(3, 4)
    ref_opt = optim.loads(optim.dumps(opt))
    ref_opt.apply_update(0, ref, grad.astype(np.float64), ref_opt.create_state(0, ref), 3)
    tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(w.astype(np.float64), ref, rtol=tol, atol=tol)


def test_float16_is_computed_in_float32_and_rounded_once():
    w = np.array([1.0, 0.5], np.float16)
    run_steps(SGD(learning_rate=1.0), w, [[0.1, 0.0001]])
    expected = (np.float32(1.0) - np.float32(0.1), np.float32(0.5) - np.float32(1e-4))
    assert w.tolist() == [float(np.float16(expected[0])), float(np.float16(expected[1]))]


def test_rescale_grad_can_be_changed_after_construction():
    opt = SGD(learning_rate=1.0)
    opt.rescale_grad = 0.25
    w = f64([0.0])
    run_steps(opt, w, [[2.0]])
    assert w.tolist() == [-0.5]


def test_grad_of_the_same_size_is_reshaped_and_other_sizes_fail():
    opt = SGD(learning_rate=1.0)
    w = f64([[1.0, 2.0], [3.0, 4.0]])
    run_steps(opt, w, [[1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(w, [[0.0, 1.0], [2.0, 3.0]])
    with pytest.raises(ValueError, match=r"gradient of shape \(3,\) does not match weight"):
        opt.update(0, w, f64([1.0, 2.0, 3.0]), None)


def test_weights_must_be_float_numpy_arrays():
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        SGD().create_state(0, np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="NumPy arrays"):
        SGD().update(0, [1.0], [1.0], None)


def test_constructor_arguments_are_checked():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['momentun'\]"):
        SGD(momentun=0.9)
    with pytest.raises(TypeError, match="lr_scheduler is not supported"):
        SGD(lr_scheduler=object())
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        SGD(learning_rate=float("nan"))
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        SGD(momentum=-0.1)
    with pytest.raises(TypeError, match="wd must be a real number"):
        SGD(wd="0.1")
    opt = SGD(param_idx2name={0: "w"}, multi_precision=True)  # MXNet arguments, ignored
    assert (opt.learning_rate, opt.rescale_grad, opt.wd, opt.clip_gradient) == (
        0.01,
        1.0,
        0.0,
        None,
    )


def test_user_subclass_contract_and_default_hooks():
    calls = []

    class Signum(Optimizer):
        """w -= lr * sign(g), recording the calls it gets."""

        def create_state(self, key, weight):
            return {"n": 0}

        def update(self, key, weight, grad, state):
            state["n"] += 1
            calls.append(key)
            weight -= self.learning_rate * np.sign(self.preprocess_grad(grad))

    opt = Signum(learning_rate=0.5, rescale_grad=-1.0)
    w = f64([1.0, 1.0])
    state = opt.create_state(("k", 2), w)
    opt.apply_update(("k", 2), w, f64([3.0, -2.0]), state, sender=9)  # default -> update()
    opt.on_pull(("k", 2), w, state, sender=9)  # default: no-op
    assert calls == [("k", 2)] and state == {"n": 1}
    np.testing.assert_array_equal(w, [1.5, 0.5])


def test_base_class_methods_are_abstract():
    with pytest.raises(NotImplementedError, match="create_state"):
        Optimizer().create_state(0, f64([1.0]))
    with pytest.raises(NotImplementedError, match="update"):
        Optimizer().update(0, f64([1.0]), f64([1.0]), None)


def test_preprocess_grad_rescales_then_clips_into_a_new_array():
    opt = Optimizer(rescale_grad=2.0, clip_gradient=1.5)
    grad = np.array([0.5, 1.0, -3.0], np.float16)
    out = opt.preprocess_grad(grad)
    assert out.dtype == np.float32
    assert out.tolist() == [1.0, 1.5, -1.5]
    assert grad.tolist() == [0.5, 1.0, -3.0]


# -------------------------------------------------------------------------- registry
def test_create_by_name_is_case_insensitive():
    assert type(optim.create("sgd")) is SGD
    assert type(optim.create("ADAM", learning_rate=0.5)) is Adam
    opt = optim.create("DcAsGd", momentum=0.9, lamda=0.1)
    assert type(opt) is DCASGD and (opt.momentum, opt.lamda) == (0.9, 0.1)


def test_create_unknown_name_lists_known_ones():
    with pytest.raises(
        ValueError, match="unknown optimizer 'rmsprop'; known optimizers: adagrad, adam, "
    ):
        optim.create("rmsprop")


def test_register_a_user_optimizer(monkeypatch):
    monkeypatch.setattr(registry_mod, "_REGISTRY", dict(registry_mod._REGISTRY))

    @optim.register
    class MySGD(SGD):
        """An SGD under another name."""

    assert type(optim.create("mysgd")) is MySGD
    assert "mysgd" in optim.registered_names()
    with pytest.raises(ValueError, match="already registered"):
        optim.register(Adam, name="SGD")
    with pytest.raises(TypeError, match="Optimizer subclasses"):
        optim.register(dict)


# --------------------------------------------------------------------- serialisation
def test_dumps_loads_a_class_defined_in_a_function():
    class HalfStep(Optimizer):
        """w -= lr/2 * g."""

        def create_state(self, key, weight):
            return None

        def update(self, key, weight, grad, state):
            weight -= 0.5 * self.learning_rate * self.preprocess_grad(grad)

    data = optim.dumps(HalfStep(learning_rate=0.2, rescale_grad=2.0))
    assert isinstance(data, bytes)
    opt = optim.loads(data)
    assert type(opt).__name__ == "HalfStep" and isinstance(opt, Optimizer)
    w = f64([1.0])
    opt.update(0, w, f64([1.0]), opt.create_state(0, w))
    np.testing.assert_allclose(w, [0.8], rtol=1e-15)


def _env_with_hetps_on_path():
    src = str(Path(optim.__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def test_loads_a_class_defined_in_another_processes_main(tmp_path):
    out = tmp_path / "opt.pkl"
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import hetps.optim as optim

        class Doubler(optim.Optimizer):
            def create_state(self, key, weight):
                return {"calls": 0}

            def update(self, key, weight, grad, state):
                state["calls"] += 1
                weight -= 2 * self.learning_rate * np.asarray(grad)

        with open(sys.argv[1], "wb") as f:
            f.write(optim.dumps(Doubler(learning_rate=0.25, wd=0.5)))
        """
    )
    subprocess.run(
        [sys.executable, "-c", script, str(out)],
        check=True,
        env=_env_with_hetps_on_path(),
        timeout=60,
    )
    opt = optim.loads(out.read_bytes())
    assert type(opt).__name__ == "Doubler" and isinstance(opt, Optimizer)
    assert (opt.learning_rate, opt.wd) == (0.25, 0.5)
    w = f64([1.0, 2.0])
    state = opt.create_state(0, w)
    opt.update(0, w, f64([1.0, -1.0]), state)
    np.testing.assert_array_equal(w, [0.5, 2.5])
    assert state == {"calls": 1}


def test_loads_rejects_what_is_not_an_optimizer():
    with pytest.raises(TypeError, match="is a dict, not a hetps.optim.Optimizer"):
        optim.loads(cloudpickle.dumps({"learning_rate": 0.1}))
    with pytest.raises(ValueError, match="cannot unpickle the optimizer"):
        optim.loads(b"not a pickle")
    with pytest.raises(TypeError, match="expects bytes"):
        optim.loads("sgd")
    with pytest.raises(TypeError, match="expects a hetps.optim.Optimizer"):
        optim.dumps(object())


def test_loads_explains_a_class_pickled_by_reference_to_a_missing_module(tmp_path, monkeypatch):
    (tmp_path / "hetps_test_user_opts.py").write_text(
        "from hetps.optim import SGD\n\nclass UserSGD(SGD):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import hetps_test_user_opts

    data = optim.dumps(hetps_test_user_opts.UserSGD())
    monkeypatch.delitem(sys.modules, "hetps_test_user_opts")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(ValueError, match="register_pickle_by_value"):
        optim.loads(data)


def test_states_round_trip_with_tuple_keys_and_resume_adam():
    rng = np.random.default_rng(3)
    opt = Adam(learning_rate=0.01, wd=0.001)
    keys = [(0, 0), (0, 1), "bias"]
    weights = {k: rng.normal(size=4) for k in keys}
    states = {k: opt.create_state(k, w) for k, w in weights.items()}
    grads = [{k: rng.normal(size=4) for k in keys} for _ in range(4)]
    for step in grads[:2]:
        for k in keys:
            opt.update(k, weights[k], step[k], states[k])

    loaded = optim.load_states(optim.dump_states(states))
    assert set(loaded) == set(keys)
    for k in keys:
        assert loaded[k]["t"] == 2
        np.testing.assert_array_equal(loaded[k]["mean"], states[k]["mean"])
        assert not np.shares_memory(loaded[k]["var"], states[k]["var"])

    resumed = {k: w.copy() for k, w in weights.items()}
    for step in grads[2:]:
        for k in keys:
            opt.update(k, weights[k], step[k], states[k])
            opt.update(k, resumed[k], step[k], loaded[k])
    for k in keys:
        np.testing.assert_array_equal(resumed[k], weights[k])


def test_dcasgd_and_empty_states_round_trip():
    opt = DCASGD(momentum=0.9)
    w = f64([1.0, 2.0])
    state = opt.create_state(1, w)
    opt.on_pull(1, w, state, sender=11)
    loaded = optim.load_states(optim.dump_states({1: state, 2: None}))
    assert loaded[2] is None
    np.testing.assert_array_equal(loaded[1]["backup"][11], [1.0, 2.0])
    assert optim.load_states(optim.dump_states({})) == {}


def test_states_under_an_allow_list_build_arrays_and_numbers_only():
    """With HETPS_OPTIMIZERS' names a state map gives back every NumPy array (strided,
    Fortran-ordered, float16), scalar and container; any other global is refused unbuilt."""
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    states = {
        ("w", 0): {"mom": np.asfortranarray(np.ones((2, 3))), "t": np.int64(3), "s": strided},
        1: (np.float16([1.5]), [np.float32(2.0), None], "x"),
    }
    loaded = optim.load_states(optim.dump_states(states), allowed={"sgd"})
    assert loaded[("w", 0)]["t"] == 3 and loaded[1][1][0] == 2.0 and loaded[1][2] == "x"
    np.testing.assert_array_equal(loaded[("w", 0)]["s"], strided)
    np.testing.assert_array_equal(loaded[("w", 0)]["mom"], np.ones((2, 3)))
    assert loaded[1][0].dtype == np.float16 and loaded[1][0][0] == 1.5
    for other in (Adam(), Path("x")):  # an optimizer, any other class
        with pytest.raises(PermissionError, match=r"states' pickle names .*\(HETPS_OPTIMIZERS\)"):
            optim.load_states(optim.dump_states({0: other}), allowed={"sgd", "adam"})


def test_load_states_rejects_foreign_bytes():
    with pytest.raises(ValueError, match="not hetps optimizer states"):
        optim.load_states(pickle.dumps({0: np.zeros(2)}))
    with pytest.raises(ValueError, match="cannot unpickle optimizer states"):
        optim.load_states(b"\x00garbage")
    with pytest.raises(TypeError, match="expects a dict"):
        optim.dump_states([np.zeros(2)])


def test_public_api_has_docstrings_and_hints():
    for name in optim.__all__:
        obj = getattr(optim, name)
        if name == "Key":
            continue
        assert obj.__doc__, name
        if isinstance(obj, type):
            for meth in ("create_state", "update", "apply_update", "on_pull"):
                fn = getattr(obj, meth)
                assert fn.__doc__, f"{name}.{meth}"
                assert "return" in fn.__annotations__, f"{name}.{meth}"
        else:
            assert "return" in obj.__annotations__, name
