"""Out of memory: the floor's oom_kind (which memory ran out) and free_memory, chapter 09's with_batch_backoff
(halve the batch and retry), with fabricated and real allocation failures, and the chapter's oom.py, which gets a
real, catchable CPU out-of-memory error under an address-space limit and backs off both ways (ours and
accelerate's)."""

import json
import re
import sys
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accelhelpers as ah
from tests import longrun_jobs as jobs


def test_oom_kind_classifies_fabricated_and_real_errors():
    assert ah.device.oom_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "cuda"
    assert ah.device.oom_kind(RuntimeError("CUDA out of memory. Tried to allocate 20 MiB")) == "cuda"
    assert ah.device.oom_kind(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)")) == "mps"
    assert ah.device.oom_kind(RuntimeError("RESOURCE_EXHAUSTED: Attempting to allocate 3G")) == "xla"
    assert ah.device.oom_kind(MemoryError()) == "cpu"
    with pytest.raises(RuntimeError) as real:
        torch.empty(2**50, dtype=torch.uint8)  # a real CPU allocation failure (1 PiB)
    assert ah.device.oom_kind(real.value) == "cpu"
    assert ah.device.oom_kind(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert ah.device.oom_kind(ValueError("CUDA out of memory")) == "cuda"  # by message, whatever the type


@pytest.mark.slow
def test_batch_backoff_frees_the_failed_step_and_halves_until_it_fits():
    tried, freed = [], []
    held: list = []

    def step(bs: int) -> str:
        tried.append(bs)
        activations = torch.ones(bs, 64)  # what a failed forward pass leaves in its frames
        held.append(weakref.ref(activations))
        if bs > 100:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {bs} MiB")
        return f"trained with {bs}"

    result = ah.longrun.with_batch_backoff(step, 512, on_backoff=lambda bs, kind: freed.append(
        (bs, kind, held[-1]() is None)))
    assert result == ("trained with 64", 64) and tried == [512, 256, 128, 64]
    assert freed == [(256, "cuda", True), (128, "cuda", True), (64, "cuda", True)]  # released before each retry


def test_batch_backoff_stops_at_the_minimum_with_a_real_cpu_oom_and_passes_other_errors():
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator") as e:
        ah.longrun.with_batch_backoff(lambda bs: torch.empty(bs * 2**40, dtype=torch.uint8), 2**10, min_batch_size=2**8)
    assert "even at min_batch_size=256" in "".join(getattr(e.value, "__notes__", []))
    calls = []

    def broken(bs):
        calls.append(bs)
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        ah.longrun.with_batch_backoff(broken, 64)
    assert calls == [64]  # not an OOM: no retry


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_oom_is_classified_released_and_backed_off():
    total_gib = torch.cuda.get_device_properties(0).total_memory // 2**30
    base = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError) as real:
        torch.empty(2 * total_gib * 2**30, dtype=torch.uint8, device="cuda")
    assert ah.device.oom_kind(real.value) == "cuda"
    del real
    start = 4 * total_gib
    _, gib = ah.longrun.with_batch_backoff(lambda g: torch.empty(g * 2**30, dtype=torch.uint8, device="cuda").numel(),
                                       start)
    assert gib < total_gib and torch.cuda.memory_allocated() == base


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "1 <= min_batch_size <= batch_size"),
    ({"batch_size": 8, "min_batch_size": 16}, "min_batch_size=16, batch_size=8"),
    ({"batch_size": 8.0}, "batch_size=8.0"),
])
def test_batch_backoff_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ah.longrun.with_batch_backoff(lambda bs: bs, **kwargs)


def test_free_memory_collects_garbage_cycles():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b
    ah.device.free_memory()
    assert ref() is None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_a_real_cpu_oom_under_a_memory_limit_is_backed_off_both_ways(tmp_path):
    script = jobs.workers(tmp_path / "workers")["oom.py"]
    code, out = jobs.finish(jobs.start(script, tmp_path, "--budget-mb", 128, "--start-batch", 65536), 300)
    assert code == 0, out[-2000:]
    r = json.loads((tmp_path / "oom.json").read_text())
    assert r["plain_kind"] == "cpu" and "DefaultCPUAllocator" in r["plain_error"]
    assert r["tried"]["ours"][:2] == [65536, 32768] and r["ours"] == r["tried"]["ours"][-1] < 65536
    assert r["tried"]["accelerate"][:2] == [65536, 58982] and r["accelerate"] == r["tried"]["accelerate"][-1]
    assert len(r["tried"]["accelerate"]) > len(r["tried"]["ours"])


SETTINGS = settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])

@SETTINGS
@given(start=st.integers(1, 4096), fits=st.integers(0, 4096), low=st.integers(1, 64))
def test_property_batch_backoff_finds_a_size_that_fits_or_reraises(start, fits, low, monkeypatch):
    low = min(low, start)
    monkeypatch.setattr(ah.device, "free_memory", lambda: None)  # gc.collect() per retry is slow; tested above

    def step(bs):
        if bs > fits:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return bs

    if fits < low:
        with pytest.raises(torch.OutOfMemoryError):
            ah.longrun.with_batch_backoff(step, start, min_batch_size=low)
    else:
        _, bs = ah.longrun.with_batch_backoff(step, start, min_batch_size=low)
        assert low <= bs <= min(start, fits) and (bs == start or 2 * bs >= fits or bs == low)
