"""Tests for accelhelpers.precision (exported from chapter 04): format facts against torch.finfo, loss scaling against
GradScaler, the policy, the training step, autocast/memory tools, checkpointing, fastai."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import accelhelpers as ah

CPU_REPORT = {"cpu_bf16_native": True}


# ---------------------------------------------------------------- number formats

@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e5m2"])
def test_ieee_facts_match_finfo(name):
    dtype, e, m, _ = ah.precision.FORMATS[name]
    fi, facts = torch.finfo(dtype), ah.precision.ieee_facts(e, m)
    assert facts["max"] == fi.max and facts["eps"] == fi.eps
    assert facts["smallest_normal"] == fi.smallest_normal


def test_ieee_facts_differ_for_e4m3fn():
    # e4m3fn ("finite") reclaims the inf exponent: its max is 448, not the IEEE-style 240
    assert ah.precision.ieee_facts(4, 3)["max"] == 240.0
    assert ah.precision.format_facts("fp8_e4m3fn")["max"] == 448.0


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
def test_smallest_subnormal_is_really_the_smallest(name):
    dtype = ah.precision.FORMATS[name][0]
    tiny = ah.precision.format_facts(name)["smallest_subnormal"]
    assert torch.tensor(tiny, dtype=torch.float64).to(dtype).item() == tiny
    assert torch.tensor(tiny / 2, dtype=torch.float64).to(dtype).item() == 0.0  # ties-to-even rounds to 0


def test_format_facts_tf32_by_formula_and_unknown_name():
    tf32 = ah.precision.format_facts("tf32")
    assert tf32["source"] == "formula" and tf32["eps"] == 2.0**-10 and tf32["smallest_normal"] == 2.0**-126
    with pytest.raises(ValueError, match="unknown format 'fp12'"):
        ah.precision.format_facts("fp12")


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2}  # written out here, not read from FORMATS: the reference is torch.finfo


def test_format_table_rows_are_torch_finfo_and_the_bit_layout():
    """Each row with a torch dtype states torch.finfo's bits, max, smallest normal and eps, and a sign, exponent and
    mantissa that add up to its bits and give that smallest normal and eps; tf32 has fp32's range and fp16's eps.
    Mutations this catches: a format's exponent or mantissa width wrong, max by the IEEE formula (240 for e4m3fn),
    eps from `finfo.resolution`, rows not in the order of the names asked for."""
    rows = {r["format"]: r for r in ah.precision.format_table()}
    assert rows.keys() == DTYPES.keys() | {"tf32"}
    for name, dtype in DTYPES.items():
        fi, row = torch.finfo(dtype), rows[name]
        assert (row["bits"], row["max"], row["smallest_normal"], row["eps"]) == (
            fi.bits, fi.max, fi.smallest_normal, fi.eps)
        assert 1 + row["exponent"] + row["mantissa"] == fi.bits
        emin = 2 - 2 ** (row["exponent"] - 1)                                    # 1 - the exponent bias
        assert row["eps"] == 2.0 ** -row["mantissa"] and row["smallest_normal"] == 2.0**emin
    tf32, fp32_top_10_bits = rows["tf32"], torch.tensor(0x7F7FE000, dtype=torch.int32).view(torch.float32).item()
    assert (tf32["exponent"], tf32["mantissa"], tf32["bits"]) == (8, 10, 32)     # stored in fp32's 32 bits
    assert (tf32["max"], tf32["smallest_normal"], tf32["eps"]) == (             # fp32's range, fp16's precision
        fp32_top_10_bits, torch.finfo(torch.float32).smallest_normal, torch.finfo(torch.float16).eps)
    asked = ["bf16", "fp8_e5m2", "fp16"]
    assert [r["format"] for r in ah.precision.format_table(asked)] == asked


def test_spacing_matches_nextafter_for_fp32():
    x = torch.tensor([1e-40, 1e-30, 1e-3, 1.0, 3.0, 1e10, 1e30], dtype=torch.float32)
    gap = (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()
    assert torch.equal(ah.precision.spacing(x, "fp32"), gap)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
def test_spacing_matches_enumerated_values(name):
    vals = ah.precision.representable(ah.precision.FORMATS[name][0])
    gaps = vals[1:] - vals[:-1]
    assert torch.equal(ah.precision.spacing(vals[:-1], name), gaps)


def test_spacing_unknown_format():
    with pytest.raises(ValueError, match="unknown format"):
        ah.precision.spacing(torch.ones(2), "int4")


@pytest.mark.parametrize("dtype,count", [(torch.float16, 31744), (torch.bfloat16, 32640),
                                         (torch.float8_e4m3fn, 127), (torch.float8_e5m2, 124)])
def test_representable_counts(dtype, count):
    vals = ah.precision.representable(dtype)
    assert vals.numel() == count and vals[0] == 0 and vals[-1] == torch.finfo(dtype).max


def test_representable_rejects_wide_dtypes():
    with pytest.raises(ValueError, match="8- and 16-bit"):
        ah.precision.representable(torch.float32)


def test_cast_report_counts_zero_subnormal_overflow():
    v = torch.tensor([1e-9, 1e-6, 1.0, 1e5, 0.0])  # the 0 is ignored
    r = ah.precision.cast_report(v, torch.float16)
    assert (r["zero"], r["subnormal"], r["overflow"], r["count"]) == (0.25, 0.25, 0.25, 4)
    r = ah.precision.cast_report(v, torch.float16, scale=2.0**10)  # scaling rescues the tiny ones, overflows more
    assert (r["zero"], r["subnormal"], r["overflow"]) == (0.0, 0.25, 0.25)
    assert ah.precision.cast_report(v, torch.bfloat16)["zero"] == 0.0  # bf16 has fp32's range


def test_cast_report_bad_input():
    with pytest.raises(ValueError, match="no non-zero values"):
        ah.precision.cast_report(torch.zeros(3))
    with pytest.raises(ValueError, match="scale > 0"):
        ah.precision.cast_report(torch.ones(3), scale=0)


def test_scaled_backward_equals_grad_scaler_and_reports_overflow():
    model, x, y = _tiny(), torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    params = list(model.parameters())

    def loss():
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.cross_entropy(model(x), y)

    assert ah.precision.scaled_backward(loss(), params, 2.0**12)
    by_hand = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(loss()).backward()
    scaler.unscale_(torch.optim.SGD(params, lr=0.0))
    assert all(torch.equal(a, p.grad) for a, p in zip(by_hand, params))  # torch's GradScaler: the same numbers
    model.zero_grad(set_to_none=True)
    assert not ah.precision.scaled_backward(loss(), params, 2.0**40)  # fp16 gradients overflow: skip this step


# ---------------------------------------------------------------- policy

HW = ah.device.Hardware


@pytest.mark.parametrize("hw,name", [
    (HW("cuda", capability=(9, 0)), "bf16"), (HW("cuda", capability=(8, 0)), "bf16"),
    (HW("cuda", capability=(7, 5)), "fp16"), (HW("xla"), "bf16"), (HW("mps"), "fp16"),
    (HW("cpu", cpu_bf16=True), "bf16"), (HW("cpu", cpu_bf16=False), "bf16")])
def test_auto_choice(hw, name):
    assert ah.precision.auto_choice(hw)[0] == name
    assert ah.precision.policy_for(hw.kind, hw=hw).scaler is (name == "fp16")


def test_auto_choice_says_when_cpu_bf16_is_emulated():
    assert "slower" in ah.precision.auto_choice(HW("cpu", cpu_bf16=False))[1]
    with pytest.raises(ValueError, match="no precision policy"):
        ah.precision.auto_choice(HW("tpu"))


def test_policy_for_cpu_runs_bf16_autocast():
    pol = ah.precision.policy_for("cpu")
    assert (pol.name, pol.scaler, pol.device_type) == ("bf16", False, "cpu")
    lin = nn.Linear(4, 3)
    with pol.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    assert not pol.grad_scaler().is_enabled()
    assert "cpu: bf16" in str(pol)


def test_policy_fp32_disables_autocast_and_fp16_scales():
    lin = nn.Linear(4, 3)
    with ah.precision.policy_for("cpu", "fp32").autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.float32
    pol = ah.precision.policy_for("cpu", "fp16")
    scaler = pol.grad_scaler(init_scale=2.0**10)
    assert pol.scaler and scaler.is_enabled()
    assert scaler.scale(torch.tensor(1.5)).item() == 1.5 * 2**10


def test_policy_for_bad_input():
    with pytest.raises(ValueError, match="prefer='fp8' is not a precision"):
        ah.precision.policy_for("cpu", "fp8")
    with pytest.raises(ValueError, match="XLA autocast runs in bf16"):
        ah.precision.policy_for("xla", "fp16")
    with pytest.raises(ValueError, match="no precision policy for device type 'meta'"):
        ah.precision.policy_for("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA bf16")
def test_policy_for_cuda_bf16_without_support():
    with pytest.raises(ValueError, match="does not support bf16"):
        ah.precision.policy_for("cuda", "bf16")


XLA_SNIPPET = """
import torch, torch_xla
import accelhelpers as ah
dev = torch_xla.device()
pol = ah.precision.policy_for(dev, hw=ah.device.Hardware("xla"))
lin = torch.nn.Linear(8, 4).to(dev)
with pol.autocast():
    y = lin(torch.randn(2, 8, device=dev))
y.float().sum().backward()
torch_xla.sync()
print(pol.name, pol.scaler, y.dtype, lin.weight.grad.dtype)
"""


@pytest.mark.slow
@pytest.mark.skipif(not ah.device.xla_installed(), reason="torch_xla not installed")
def test_xla_policy_really_runs_bf16_on_pjrt_cpu():
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", XLA_SNIPPET], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["bf16", "False", "torch.bfloat16", "torch.float32"]


def test_minibatch_step_under_each_policy():
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def step(policy, **scaler_kwargs):
        model = _tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = policy.grad_scaler(**scaler_kwargs) if policy is not None else None
        loss = ah.precision.minibatch_step(model, opt, x, y, policy, scaler)
        return loss, [p.detach() for p in model.parameters()], scaler

    plain, fp32, bf16 = step(None), step(ah.precision.policy_for("cpu", "fp32")), step(ah.precision.policy_for("cpu"))
    ref = _tiny()  # the same step written out with torch alone
    nn.functional.cross_entropy(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(plain[1], ref.parameters()))
    assert plain[0].item() == fp32[0].item() and all(torch.equal(a, b) for a, b in zip(plain[1], fp32[1]))
    assert bf16[0].dtype == torch.float32 and bf16[0].item() != plain[0].item()  # bf16 forward, fp32 loss
    assert all(not torch.equal(a, b) for a, b in zip(bf16[1], _tiny().parameters()))  # and the step was taken
    loss, params, scaler = step(ah.precision.Policy("cpu", torch.float16, True, "test"), init_scale=2.0**40)
    assert scaler.get_scale() == 2.0**39  # fp16 gradients overflowed: the scaler halved the scale ...
    assert all(torch.equal(a, b) for a, b in zip(params, _tiny().parameters()))  # ... and skipped the step


# ---------------------------------------------------------------- what autocast does

def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_op_dtypes_under_cpu_autocast():
    model, x, y = _tiny(), torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])

    def loss(policy):
        def run():
            with policy.autocast():
                return nn.functional.cross_entropy(model(x), y)
        return run

    mixed = ah.precision.op_dtypes(loss(ah.precision.policy_for("cpu", "bf16")))
    assert [o for op, _, o in mixed if op == "addmm"] == ["bfloat16", "bfloat16"]
    assert [o for op, _, o in mixed if op == "_log_softmax"] == ["float32"]  # autocast keeps it in fp32
    plain = ah.precision.op_dtypes(loss(ah.precision.policy_for("cpu", "fp32")))
    assert {o for _, _, o in plain} == {"float32"} and "_to_copy" not in [op for op, _, _ in plain]


def test_autocast_halves_the_saved_bytes_and_adds_weight_copies():
    lin, x = nn.Linear(32, 64), torch.randn(10, 32)
    fwd = lambda: torch.relu(lin(x))
    # fp32: addmm saves its input (for the weight gradient), relu saves its output
    assert ah.metrics.saved_bytes(fwd, lin.parameters()) == (10 * 32 + 10 * 64) * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same tensors, in bf16: half the bytes
        assert ah.metrics.saved_bytes(fwd, lin.parameters()) == (10 * 32 + 10 * 64) * 2
    x.requires_grad_(True)  # now the weight is saved too, for the input gradient
    assert ah.metrics.saved_bytes(fwd, lin.parameters()) == (10 * 32 + 10 * 64) * 4  # ... the parameter: excluded
    assert ah.metrics.saved_bytes(fwd) == (10 * 32 + 10 * 64 + 32 * 64) * 4  # ... unless not excluded
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast saves its bf16 copy of the weight
        assert ah.metrics.saved_bytes(fwd, lin.parameters()) == (10 * 32 + 10 * 64 + 32 * 64) * 2
    assert ah.metrics.saved_bytes(lambda: None) == 0


# ---------------------------------------------------------------- gradients and loss scaling

def test_gradients_match_autograd():
    model, x, y = _tiny(), torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    g = ah.precision.gradients(model, x, y)
    ref = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
    assert torch.allclose(g["parameters"], torch.cat([r.flatten() for r in ref]))
    assert g["activations"].numel() == 6 * (16 + 4)
    scaled = ah.precision.gradients(model, x, y, scale=2.0**10)
    assert all(torch.equal(g[k], scaled[k]) for k in g)  # a power-of-2 scale is exact
    g16 = ah.precision.gradients(model, x, y, torch.float16, scale=2.0**8)  # fp16 autocast: close, not equal
    assert not torch.equal(g16["parameters"], g["parameters"])
    assert torch.allclose(g16["parameters"], g["parameters"], rtol=0.05, atol=1e-3)
    with pytest.raises(ValueError, match="no Linear/Conv"):
        ah.precision.gradients(nn.Sequential(nn.ReLU()), x, y)
    with pytest.raises(ValueError, match="scale must be positive"):
        ah.precision.gradients(model, x, y, scale=0)


def test_scaler_trace_skips_on_overflow_and_grows():
    model, x, y = _tiny(), torch.randn(32, 8), torch.randint(0, 4, (32,))
    tr = ah.precision.scaler_trace(model, x, y, 12, init_scale=2.0**22, growth_interval=3)
    assert tr[0]["skipped"] and tr[1]["scale"] == tr[0]["scale"] / 2  # 2**22 overflows fp16 gradients
    assert tr[1]["loss"] == tr[0]["loss"]  # a skipped step leaves the weights untouched
    assert any(b["scale"] > a["scale"] for a, b in zip(tr, tr[1:]))  # after clean steps the scale grows again
    with pytest.raises(ValueError, match="steps must be >= 1"):
        ah.precision.scaler_trace(model, x, y, 0)


# ---------------------------------------------------------------- measurements

def test_matmul_precision_restores_setting():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        before = torch.get_float32_matmul_precision()
        rows = ah.precision.matmul_precision(128, min_time=0.001)
        assert torch.get_float32_matmul_precision() == before
    assert [r["setting"] for r in rows] == ["highest", "high", "medium"]
    assert rows[0]["rel_error"] < 1e-5 and all(r["gflops"] > 0 for r in rows)
    assert rows[0]["speedup"] == (1.0, 1.0, 1.0)  # 'highest' against itself, round by round
    assert all(isinstance(r["speedup"], ah.timing.Spread) for r in rows)
    assert all(r["speedup"].lo <= r["speedup"].median <= r["speedup"].hi for r in rows)


# ---------------------------------------------------------------- activation checkpointing

@pytest.mark.slow
def test_checkpointed_keeps_the_gradients_and_holds_fewer_bytes():
    torch.manual_seed(0)
    deep, x, y = ah.models.mlp([8] + [32] * 8 + [4]), torch.randn(16, 8), torch.randint(0, 4, (16,))
    grads, held = {}, {}
    for segments in (None, 4, 2):
        deep.zero_grad(set_to_none=True)
        loss = lambda s=segments: nn.functional.cross_entropy(ah.precision.checkpointed(deep, x, s), y)
        loss().backward()
        grads[segments] = [p.grad.clone() for p in deep.parameters()]
        held[segments] = ah.metrics.saved_bytes(loss, deep.parameters())
    for segments in (4, 2):  # recomputation in backward gives the same gradients as keeping the activations
        assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(grads[segments], grads[None]))
        assert held[segments] < held[None]
    assert torch.equal(ah.precision.checkpointed(deep, x, None), deep(x))


# ---------------------------------------------------------------- fastai

def _learner():
    import fastai.callback.fp16  # noqa: F401  (adds Learner.to_fp16 / to_bf16)
    from fastai.basics import DataLoaders, Learner

    split = ah.data.digits()
    dls = DataLoaders.from_dsets(list(zip(split.x_train, split.y_train, strict=True)),
                                 list(zip(split.x_test, split.y_test, strict=True)), bs=512, device="cpu")
    torch.manual_seed(0)
    learn = Learner(dls, nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                    loss_func=nn.CrossEntropyLoss())
    seen = set()
    learn.model[0].register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    return learn, seen


def _fit(learn):
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)


def test_fastai_upstream_behaviour_on_cpu_is_what_the_chapter_says():
    if torch.cuda.is_available():
        pytest.skip("checks fastai's CPU behaviour")
    learn, seen = _learner()
    learn.to_fp16()
    _fit(learn)
    assert seen == {torch.float32}  # to_fp16() on CPU: no error, but nothing runs in half precision
    learn, seen = _learner()
    learn.to_bf16()
    try:
        _fit(learn)
    except RuntimeError as e:  # torch 2.9 (our pin): autocast("cuda", bfloat16) refuses
        assert "does not support bfloat16" in str(e)
    else:  # newer torch (make test-compat): autocast("cuda") is disabled with a warning, and it trains in fp32
        assert seen == {torch.float32}


@pytest.mark.parametrize("prefer,dtype,scaled", [(None, torch.bfloat16, False), ("fp16", torch.float16, True)])
def test_to_mixed_runs_on_cpu(prefer, dtype, scaled):
    learn, seen = _learner()
    ah.precision.to_mixed(learn.to_fp16(), prefer)  # replaces fastai's own callback
    _fit(learn)
    assert seen == {dtype} and learn.precision_policy.scaler is scaled
    assert sum(type(cb).__name__.endswith("MixedPrecision") for cb in learn.cbs) == 1
    ah.precision.to_mixed(learn, "fp32")
    assert not any(type(cb).__name__.endswith("MixedPrecision") for cb in learn.cbs)
