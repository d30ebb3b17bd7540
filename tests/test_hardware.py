"""Hardware decisions as functions of a hardware description (ah.device.Hardware), checked against a table of real
machines: chapter 02's bf16 row (bf16_ok), chapter 04's precision policy (auto_choice, policy_for), chapter 06's rank
placement (rank_placement) and chapter 11's FlashAttention and CUDA-graphs rows (needs, plan).

Sources of the facts in PROFILES:
- compute capabilities: NVIDIA's "CUDA GPUs - Compute Capability" table, https://developer.nvidia.com/cuda-gpus
  (T4 7.5, V100 7.0, A100 8.0, L4 8.9, H100 9.0);
- memory: NVIDIA's datasheets (T4 16 GB GDDR6, L4 24 GB GDDR6, V100 16 or 32 GB HBM2, A100 40 or 80 GB HBM2/HBM2e,
  H100 SXM 80 GB HBM3); Colab's T4 and L4 show 15 and 22.5 GiB of it to CUDA (nvidia-smi on Colab: 15360MiB and
  23034MiB);
- Colab's TPU runtime is a TPU v5e-1 since the v2-8 was retired in September 2025 (googlecolab/colabtools#5566,
  https://github.com/googlecolab/colabtools/issues/5566); its torch is 2.9.0 with torch_xla 2.9.0 (/work/shared/colab);
- bf16 in hardware: CUDA from compute capability 8.0 (Ampere); `torch.cuda.is_bf16_supported()` defaults to
  including_emulation=True and so answers True on a T4 (torch/cuda/__init__.py, torch 2.9); CPUs with AVX512_BF16
  (Intel Cooper Lake, AMD Zen 4) or AMX-BF16 (Intel Sapphire Rapids), the `avx512_bf16`/`amx_bf16` cpuinfo flags;
- FlashAttention in PyTorch's SDPA: check_flash_attention_hardware_support in
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp requires sm 8.0 or newer;
- Slurm --gpus-per-task binds each task its own GPU(s) and sets that task's CUDA_VISIBLE_DEVICES to them (srun's
  man page, --gpus-per-task: "implicitly set --tres-bind=gres/gpu:per_task"); the task sees SLURM_GPUS_PER_TASK up to
  Slurm 23.02 and SLURM_TRES_PER_TASK=gres/gpu:N from 23.11 (SchedMD/slurm commit 475e4a611b).
"""

import pytest
import torch

import accelhelpers as ah

HW = ah.device.Hardware

# name -> (description, bf16 in hardware, chapter 04's automatic precision, FlashAttention row runs)
PROFILES = {
    "Colab T4": (HW("cuda", "Tesla T4", (7, 5), 15.0, 1), False, "fp16", False),
    "V100": (HW("cuda", "Tesla V100-SXM2-16GB", (7, 0), 16.0, 1), False, "fp16", False),
    "Colab L4": (HW("cuda", "NVIDIA L4", (8, 9), 22.5, 1), True, "bf16", True),
    "A100 40GB": (HW("cuda", "NVIDIA A100-SXM4-40GB", (8, 0), 40.0, 1), True, "bf16", True),
    "A100 80GB": (HW("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80.0, 1), True, "bf16", True),
    "H100": (HW("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80.0, 1), True, "bf16", True),
    "8 x A100, all visible": (HW("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80.0, 8), True, "bf16", True),
    "8 x A100, --gpus-per-task=1": (HW("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80.0, 1, gpus_per_task=True),
                                    True, "bf16", True),
    "Colab TPU v5e-1": (HW("xla", tpu="v5e"), True, "bf16", False),
    "Apple MPS": (HW("mps"), False, "fp16", False),
    "CPU with AVX512_BF16/AMX": (HW("cpu", cpu_bf16=True), True, "bf16", False),
    "CPU without": (HW("cpu", cpu_bf16=False), False, "bf16", False),
}
CUDA_BELOW_SM80 = ("Colab T4", "V100")


@pytest.fixture
def torch_says_bf16(monkeypatch):
    """torch.cuda.is_bf16_supported() as a T4 answers it (True: emulation counts): the decisions must not ask it."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


@pytest.mark.parametrize("name", PROFILES)
def test_bf16_follows_the_hardware_not_torch_cuda_is_bf16_supported(name, torch_says_bf16):
    hw, native, choice, _ = PROFILES[name]
    assert hw.bf16_native is native
    # chapter 02: the bf16 row runs on every CPU (emulated where it must), on CUDA from sm 8.0, nowhere else
    assert ah.fullbatch.bf16_ok(hw) is (hw.kind == "cpu" or (hw.kind == "cuda" and native))
    # chapter 04: the automatic choice, and whether it scales the loss
    assert ah.precision.auto_choice(hw)[0] == choice
    assert ah.precision.policy_for(hw.kind, hw=hw).scaler is (choice == "fp16")


@pytest.mark.parametrize("name", CUDA_BELOW_SM80)
def test_asking_for_bf16_below_sm80_raises_though_torch_says_yes(name, torch_says_bf16):
    hw = PROFILES[name][0]
    with pytest.raises(ValueError, match=f"this CUDA GPU \\({hw.gpu}\\) does not support bf16"):
        ah.precision.policy_for("cuda", "bf16", hw=hw)
    assert ah.precision.policy_for("cuda", "fp16", hw=hw).scaler


@pytest.mark.parametrize("name", ["Colab L4", "A100 80GB", "H100", "Colab TPU v5e-1", "CPU without"])
def test_asking_for_bf16_works_where_it_runs(name):
    hw = PROFILES[name][0]
    pol = ah.precision.policy_for(hw.kind, "bf16", hw=hw)
    assert (pol.name, pol.scaler, pol.device_type) == ("bf16", False, hw.kind)


def test_hardware_report_says_native_cuda_bf16(monkeypatch, torch_says_bf16):
    """The report's cuda_bf16 is the native answer: False on a T4, where torch.cuda.is_bf16_supported() says True."""
    t4 = PROFILES["Colab T4"][0]

    class Props:
        name, major, minor, total_memory = t4.gpu, 7, 5, 15 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    monkeypatch.setenv("ACCEL_DEVICE", "cpu")  # the report's best device would otherwise be cuda: keep it honest
    for k in ("SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK"):
        monkeypatch.delenv(k, raising=False)
    assert ah.device.Hardware.here("cuda") == HW("cuda", "Tesla T4", (7, 5), 15.0, 1, False,
                                                 ah.device.Hardware.here("cpu").cpu_bf16)
    r = ah.device.hardware_report()
    assert (r["compute_capability"], r["cuda_bf16"]) == ("7.5", False)


# --- chapter 11: the FlashAttention row and the row after it -------------------------------------------------------

ROWS = [ah.speedrun.Row("SDPA", {"attention": "sdpa"}), ah.speedrun.Row("mixed precision", {"precision": "mixed"}),
        ah.speedrun.Row("FlashAttention", {"backend": "flash"}),
        ah.speedrun.Row("CUDA graphs", {"compile": "reduce-overhead"})]


def faster_with_each_change(tr, seed):
    changed = sum(getattr(tr.recipe, f) != getattr(ah.speedrun.Recipe(), f) for f in ("attention", "precision",
                                                                                      "backend", "compile"))
    return ah.speedrun.TargetRun(seed, True, 100, 10.0 * 0.9**changed, 1.0)


@pytest.mark.parametrize("name", PROFILES)
def test_flash_row_runs_only_from_sm80_and_its_backend_is_not_inherited_when_skipped(name, stub_trainer):
    hw, _, _, flash = PROFILES[name]
    assert hw.flash_attention is flash
    why = ah.speedrun.needs({"backend": "flash"}, hw, devices=1)
    assert (why is None) is flash
    if hw.kind == "cuda" and not flash:
        assert why == f"needs compute capability 8.0 or newer (FlashAttention), {hw.gpu} here"
    start = stub_trainer(ah.speedrun.Recipe())
    _, trials = ah.speedrun.keep_what_helps(ROWS, start, stub_trainer, [0, 1], faster_with_each_change, hw, devices=1)
    tried = {t.name: t for t in trials}
    assert (tried["FlashAttention"].skipped is None) is flash
    graphs = tried["CUDA graphs"]
    if hw.kind != "cuda":
        assert graphs.skipped == "skipped: needs CUDA (CUDA graphs)"
    else:  # a T4 tries CUDA graphs on the stack kept before the skipped FlashAttention row
        assert graphs.skipped is None and graphs.kept
        assert graphs.recipe == ah.speedrun.Recipe(attention="sdpa", precision="mixed", compile="reduce-overhead",
                                                   backend="flash" if flash else None)


def test_other_sdpa_backends_need_only_cuda():
    t4 = PROFILES["Colab T4"][0]
    assert ah.speedrun.needs({"backend": "efficient"}, t4, devices=1) is None
    assert ah.speedrun.needs({"backend": "efficient"}, HW("cpu"), 1) == "needs CUDA (a GPU's SDPA backend)"


# --- chapter 06: where each rank runs -----------------------------------------------------------------------------

@pytest.mark.parametrize("local_rank", range(8))
def test_eight_gpu_node_gives_each_of_eight_ranks_its_own_gpu_under_both_bindings(local_rank):
    all_visible = PROFILES["8 x A100, all visible"][0]
    assert ah.parallel.rank_placement(all_visible, local_rank, 8) == (torch.device("cuda", local_rank), "nccl")
    per_task = PROFILES["8 x A100, --gpus-per-task=1"][0]  # Slurm set CUDA_VISIBLE_DEVICES to the task's own GPU
    assert ah.parallel.rank_placement(per_task, local_rank, 8) == (torch.device("cuda", 0), "nccl")


def test_two_ranks_on_one_colab_t4_run_on_the_cpu():
    t4 = PROFILES["Colab T4"][0]
    for rank in (0, 1):  # nccl refuses two ranks on one GPU ("Duplicate GPU detected")
        assert ah.parallel.rank_placement(t4, rank, 2) == (torch.device("cpu"), "gloo")
    assert ah.parallel.rank_placement(t4, 0, 1) == (torch.device("cuda", 0), "nccl")


@pytest.mark.parametrize("name", ["Colab TPU v5e-1", "Apple MPS", "CPU with AVX512_BF16/AMX", "CPU without"])
def test_ranks_without_cuda_use_gloo_on_the_cpu(name):
    assert ah.parallel.rank_placement(PROFILES[name][0], 1, 2) == (torch.device("cpu"), "gloo")


def test_accel_device_cpu_makes_the_description_a_cpu(monkeypatch):
    monkeypatch.setenv("ACCEL_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ah.device.Hardware.here().kind == "cpu"
    assert ah.parallel.rank_placement(ah.device.Hardware.here(), 0, 1) == (torch.device("cpu"), "gloo")


@pytest.mark.parametrize("env,bound", [({}, False), ({"SLURM_GPUS_PER_TASK": "1"}, True),
                                       ({"SLURM_TRES_PER_TASK": "cpu=8,gres/gpu:1"}, True),
                                       ({"SLURM_TRES_PER_TASK": "cpu=8"}, False)])
def test_here_reads_slurms_per_task_binding(monkeypatch, env, bound):
    for k in ("SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ah.device.Hardware.here("cpu").gpus_per_task is bound


def test_tpu_generation_from_the_pci_bus(tmp_path):
    for i, (vendor, device) in enumerate([("0x8086", "0x0063"), ("0x1ae0", "0x0063")]):
        d = tmp_path / f"0000:00:0{i}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    assert ah.device.tpu_generation(tmp_path) == "v5e"
    assert ah.device.tpu_generation(tmp_path / "none") is None


@pytest.mark.parametrize("name,refused", [("Colab T4", True), ("V100", True), ("A100 40GB", False)])
def test_reproduce_refuses_bf16_below_sm80(monkeypatch, tmp_path, torch_says_bf16, name, refused):
    """`python -m accelhelpers reproduce --precision bf16` on a GPU: refused below sm 8.0, where torch says yes."""
    from accelhelpers.commands import CommandError, reproduce

    monkeypatch.setattr(reproduce, "_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(ah.device.Hardware, "here", classmethod(lambda cls, device=None: PROFILES[name][0]))
    check = lambda: reproduce._check_args(tmp_path / "run", False, reproduce.Settings(precision="bf16"), [1], 1, False)
    if refused:
        with pytest.raises(CommandError, match="this GPU has no bf16"):
            check()
    else:
        check()
