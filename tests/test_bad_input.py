"""Bad input across the public helpers gets a clear error (and what is not checked yet), and property-based tests
over the main entry points: every valid input works, every invalid one is refused with a message that names it."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accelhelpers as ah

GOOD = [  # (call, exception type, message naming the argument and the valid range)
    ("best_device('tpu')", lambda: ah.device.best_device("tpu"), ah.device.DeviceUnavailable,
     "choose one of cuda, xla, mps, cpu"),
    ("best_device(absent)", lambda: ah.device.best_device("mps"), ah.device.DeviceUnavailable, "present here: cpu"),
    ("setup(device='fpga')", lambda: ah.session.setup("x", device="fpga", verbose=False), ah.device.DeviceUnavailable,
     "unknown device 'fpga'"),
    ("setup(chapter='')", lambda: ah.session.setup("", verbose=False), ValueError, "chapter must be a non-empty name"),
    ("digits(test_size=0)", lambda: ah.data.digits(test_size=0), ValueError,
     "test_size must be between 0 and 1, got 0"),
    ("digits(test_size=1.5)", lambda: ah.data.digits(test_size=1.5), ValueError, "between 0 and 1, got 1.5"),
    ("mlp([40])", lambda: ah.models.mlp([40]), ValueError, "at least two positive layer sizes"),
    ("mlp([40,0,10])", lambda: ah.models.mlp([40, 0, 10]), ValueError, r"positive layer sizes, got \[40, 0, 10\]"),
    ("udl_sizes(5)", lambda: ah.models.udl_sizes(5), ValueError, r"depths \[1, 2, 3, 4\], not 5"),
    ("udl_mlp(n_in=-1)", lambda: ah.models.udl_mlp(2, n_in=-1), ValueError, "positive layer sizes"),
    ("benchmark(repeats=0)", lambda: ah.timing.benchmark(lambda: None, repeats=0), ValueError, "repeats >= 1"),
    ("benchmark(warmup=-1)", lambda: ah.timing.benchmark(lambda: None, warmup=-1), ValueError, "warmup >= 0"),
    ("mlp_flops(batch=0)", lambda: ah.timing.mlp_flops([40, 10], 0), ValueError, "batch > 0"),
    ("record(name='')", lambda: ah.results.record("", 1.0), ValueError, "a result needs a name"),
    ("course profile", lambda: ah.commands.course.check_args("fast", None, Path("build")),
     ah.commands.course.CourseError, "unknown profile 'fast': choose one of quick, full"),
    ("course --only 99", lambda: ah.commands.course.check_args("quick", "99", Path("build")),
     ah.commands.course.CourseError, "no chapter '99': choose from"),
    ("course --only ,", lambda: ah.commands.course.check_args("quick", ",", Path("build")),
     ah.commands.course.CourseError, "named no chapter"),
]
FLOOR = [  # the floor's and timing's own checks (once gaps: torch internals or silent nonsense), and one valid input
    ("best_device('cpu:x')", lambda: ah.device.best_device("cpu:x"), ah.device.DeviceUnavailable, "kind:N"),
    ("best_device('Cpu:0')", lambda: ah.device.best_device("Cpu:0"), None, None),
    ("sync('gpu')", lambda: ah.timing.sync("gpu"), ValueError, "choose one of cuda, xla, mps, cpu"),
    ("digits(device='gpu')", lambda: ah.data.digits(device="gpu"), ah.device.DeviceUnavailable, "choose one of"),
    ("Split(empty)", lambda: ah.data.Split(*(torch.zeros(0),) * 4), ValueError, "x_train.*empty"),
    ("Split(lengths differ)", lambda: ah.data.Split(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long),
                                                 torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)),
     ValueError, "y_train"),
    ("mlp([40, 2.5, 10])", lambda: ah.models.mlp([40, 2.5, 10]), ValueError, "positive"),
    ("cnn1d(channels=0)", lambda: ah.models.cnn1d(channels=0), ValueError, "channels"),
    ("cnn2d(n_classes=0)", lambda: ah.models.cnn2d(n_classes=0), ValueError, "n_classes"),
    ("matmul_gflops(0)", lambda: ah.timing.matmul_gflops(0), ValueError, "n must be"),
    ("copy_gbps(-5)", lambda: ah.timing.copy_gbps(-5), ValueError, "n_bytes must be"),
    ("time_unsynced(calls=0)", lambda: ah.timing.time_unsynced(lambda: None, calls=0), ValueError, "calls"),
    ("Timing([])", lambda: ah.timing.Timing([]), ValueError, "times"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, call, exc, message", GOOD, ids=[g[0] for g in GOOD])
def test_bad_input_gets_a_clear_error(name, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


@pytest.mark.parametrize("name, call, exc, message", FLOOR, ids=[g[0] for g in FLOOR])
def test_bad_input_to_the_floor_gets_a_clear_error(name, call, exc, message):
    if exc is None:  # valid input that must simply work
        call()
        return
    with pytest.raises(exc, match=message):
        call()


def test_an_unknown_profile_name_is_refused(monkeypatch):
    monkeypatch.setenv("ACCEL_PROFILE", "fast")
    with pytest.raises(ValueError, match="ACCEL_PROFILE='fast' is not a profile: choose one of quick, full"):
        ah.device.choose_profile()


# --- property-based tests over the main entry points ---------------------------------------------------------------


SETTINGS = settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])

@SETTINGS
@given(sizes=st.lists(st.integers(-3, 40), max_size=5), batch=st.integers(-2, 64))
def test_property_mlp_and_its_flops_accept_exactly_the_valid_sizes(sizes, batch):
    valid = len(sizes) >= 2 and all(s > 0 for s in sizes)
    if not valid:
        with pytest.raises(ValueError, match="positive layer sizes"):
            ah.models.mlp(sizes)
        with pytest.raises(ValueError, match="positive layer sizes"):
            ah.timing.mlp_flops(sizes, max(batch, 1))
        return
    model = ah.models.mlp(sizes)
    assert ah.models.count_params(model) == sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
    if batch <= 0:
        with pytest.raises(ValueError, match="batch > 0"):
            ah.timing.mlp_flops(sizes, batch)
    else:
        first_layer_input_grad = 2 * batch * sizes[0] * sizes[1]
        assert ah.timing.mlp_flops(sizes, batch) == 3 * ah.timing.mlp_flops(sizes, batch, backward=False) - \
            first_layer_input_grad

@SETTINGS
@given(depth=st.integers(-3, 8))
def test_property_udl_depths(depth):
    if depth in (1, 2, 3, 4):
        assert abs(ah.models.count_params(ah.models.udl_mlp(depth, seed=0)) - 15_200) < 400
    else:
        with pytest.raises(ValueError, match=r"depths \[1, 2, 3, 4\]"):
            ah.models.udl_sizes(depth)

@SETTINGS
@given(name=st.text(alphabet="cpumdaxl:0123 -", max_size=7))
def test_property_best_device_returns_the_cpu_or_a_clear_error(name, monkeypatch):
    kind, colon, index = name.partition(":")
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    if kind == "xla":  # a well-formed name would start torch_xla's runtime in this process: check the refusals
        if colon and not index.isdigit():
            with pytest.raises(ah.device.DeviceUnavailable, match="write 'kind' or 'kind:N'"):
                ah.device.best_device(name)
        return
    try:
        dev = ah.device.best_device(name or None)
    except ah.device.DeviceUnavailable as e:
        assert repr(name) in str(e) and "cpu" in str(e)
    else:
        assert dev.type == "cpu"

@SETTINGS
@given(value=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=8))
def test_property_profile_is_valid_or_refused(value, monkeypatch):
    monkeypatch.setenv("ACCEL_PROFILE", value)
    try:
        assert ah.device.choose_profile() in ("quick", "full")
    except ValueError as e:
        assert "ACCEL_PROFILE" in str(e) and "choose one of quick, full" in str(e)

@SETTINGS
@given(name=st.text(max_size=6), value=st.one_of(st.floats(), st.integers(), st.booleans()))
def test_property_record_keeps_any_number_under_a_nonempty_name(name, value):
    ah.results.set_chapter("prop")
    if not name:
        with pytest.raises(ValueError, match="needs a name"):
            ah.results.record(name, value)
        return
    assert ah.results.record(name, value) is value
    stored = {e["name"]: e["value"] for e in ah.results.load_chapter(ah.results.results_dir() / "prop.json")}
    assert stored[name] == (value if isinstance(value, (int, bool)) or math.isfinite(value) else str(value))
