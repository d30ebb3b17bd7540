"""Shared fixtures: every test writes its results and cache into a temporary folder."""

import pytest


@pytest.fixture(autouse=True)
def _isolated_outputs(tmp_path, monkeypatch):
    """Keep results and builds of unit tests out of the checkout's build/ (the data cache stays shared)."""
    monkeypatch.setenv("ACCEL_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("ACCEL_BUILD", str(tmp_path / "build"))
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)


# torch 2.14.1 (make test-compat only): a gloo worker sometimes aborts at exit, after its work and its result files
# are done, with "terminate called without an active exception" (seen in about 1 of 5 compat runs, on a different
# multi-process test each time; never with our pinned torch 2.9). Multi-process tests rerun such a launch once in
# the compat environment; the rerun must then pass every check. Any other failure, or this one with our pins,
# fails as before.
TEARDOWN_ABORT = "terminate called without an active exception"


def compat_teardown_abort(output: str) -> bool:
    """True for the known torch 2.14 exit-time abort of a gloo worker, in `make test-compat` only."""
    import os

    return os.environ.get("ACCEL_COMPAT") == "1" and TEARDOWN_ABORT in output


# --- the tiers ------------------------------------------------------------------------------------------------------
# `make test-fast` (the edit-test loop) runs every test not marked slow; `make test` runs them all. Slow: a notebook,
# and the tests below, which start other processes (torchrun, a course run, JupyterLab, Slurm, g++) or train for
# seconds: each took 1.5 s or more in `pytest tests --durations=0` on the 2-core machine. A new slow test goes here
# (tests/test_tiers.py checks that every name still exists). A test that uses one of the module fixtures in
# SLOW_FIXTURES (each starts processes or a cluster for its module) is slow too, whichever test runs it first.
SLOW = {
    "test_bad_input": {
        "test_bad_input_gets_a_clear_error",
    },
    "test_browser": {
        "test_chapter_01_runs_in_jupyterlab_without_errors",
        "test_course_report_renders",
        "test_the_error_check_catches_an_exception",
    },
    "test_worker_edits": {
        "test_an_edited_cell_reaches_the_launched_workers",
    },
    "test_checkpoint": {
        "test_a_process_killed_during_a_save_leaves_the_previous_checkpoint_loadable",
        "test_exact_resume_in_a_fresh_process_is_bit_identical",
        "test_save_and_load_restore_every_state_and_the_step",
        "test_unwrap_removes_data_parallel_and_compile_wrappers",
    },
    "test_course": {
        "test_bad_input_is_one_clear_message_and_writes_nothing",
        "test_cli_says_bad_input_in_one_line_and_leaves_a_bug_its_traceback",
        "test_course_run_never_writes_into_recorded_results",
        "test_course_run_passes_the_profile_as_a_parameter",
        "test_env_prints_the_report",
        "test_papermill_parameters_take_effect_in_a_real_chapter",
        "test_plain_pytest_nbval_compares_the_quick_cpu_run_on_any_machine",
        "test_readme_tables_are_exactly_what_the_command_writes",
        "test_real_chapter_01_through_the_cli",
        "test_run_goes_on_past_a_failing_chapter_and_names_it",
    },
    "test_course_runner": {
        "test_course_reruns_overwrite_cleanly_and_ctrl_c_leaves_the_report_whole",
    },
    "test_data_models": {
        "test_corrupt_cache_is_regenerated",
        "test_fastai_patches_add_the_learner_methods_the_chapters_call",
        "test_mnist1d_shapes_and_cache",
    },
    "test_deploy": {
        "test_fit_classifier_is_the_plain_adamw_one_cycle_loop",
        "test_hls4ml_emulation_is_bit_exact_with_numpy_model",
        "test_hls_conversions_in_threads_do_not_break_each_others_trace",
        "test_onnx_export_parity_and_int8_by_hand_equals_ort",
        "test_static_quantization",
    },
    "test_device": {
        "test_colab_detection_never_raises_without_a_google_package",
        "test_tpu_pci_ids_are_torch_xlas",
    },
    "test_fullbatch": {
        "test_ablation_rows_are_medians_with_enough_steps_and_ratios_per_round",
        "test_bench_runs_every_variant_and_writes_the_schema",
        "test_compiled_step_matches_eager",
        "test_every_ablation_switch_gives_the_same_losses",
        "test_fast_path_follows_the_naive_trajectory",
        "test_fastai_learner_runs_the_same_workload",
        "test_fullgraph_step_follows_the_naive_trajectory_and_trains_the_model_in_place",
        "test_fullgraph_test_every_k_changes_only_when_the_test_error_is_measured",
        "test_graph_breaks_counts_what_dynamo_makes_of_each_step_and_trains_nothing",
        "test_many_models_train_exactly_as_each_alone",
        "test_padding_to_the_vector_width_changes_nothing_but_speed",
        "test_udlbooks_loop_takes_the_training_error_from_the_steps_own_forward_pass",
    },
    "test_launch": {
        "test_a_deadline_kills_the_whole_group_even_a_silent_child",
    },
    "test_layout": {
        "test_no_notebook_and_no_module_below_the_commands_uses_them",
    },
    "test_longrun": {
        "test_a_run_killed_between_checkpoints_resumes_bit_identical_in_a_new_process",
        "test_fsdp2_shards_saved_by_two_ranks_load_into_one_process",
        "test_a_save_killed_half_way_loses_everything_with_torch_save_and_nothing_atomically",
        "test_a_worker_killed_mid_run_is_restarted_and_resumes_from_the_last_checkpoint",
        "test_every_state_left_out_of_a_resume_changes_the_result",
        "test_finish_and_wait_for_kill_a_worker_that_outlives_its_timeout",
        "test_torchrun_restarts_a_killed_worker_and_it_resumes_from_the_last_checkpoint",
        "test_wait_for_times_out_when_the_group_has_gone_before_the_kill",
    },
    "test_nonfinite": {
        "test_a_nan_on_one_rank_stops_both_when_agreed_and_strands_the_other_when_local",
        "test_ddp_all_ranks_stop_together_when_only_one_sees_a_nan",
    },
    "test_oom": {
        "test_a_real_cpu_oom_under_a_memory_limit_is_backed_off_both_ways",
        "test_batch_backoff_frees_the_failed_step_and_halves_until_it_fits",
    },
    "test_optim": {
        "test_matches_torch_optim",
    },
    "test_parallel": {
        "test_pipeline_refuses_other_than_two_ranks",
        "test_setup_rank_picks_gloo_on_the_cpu_here_and_announces_it",
        "test_two_ranks_of_batch_b_equal_one_process_of_batch_2b",
    },
    "test_peers": {
        "test_a_dead_or_stuck_peer_is_a_clear_error_within_the_timeout_not_a_hang",
    },
    "test_pipeline": {
        "test_memory_fits_backs_off_on_any_devices_out_of_memory",
        "test_memory_fits_backs_off_on_out_of_memory",
    },
    "test_precision": {
        "test_checkpointed_keeps_the_gradients_and_holds_fewer_bytes",
        "test_xla_policy_really_runs_bf16_on_pjrt_cpu",
    },
    "test_preemption": {
        "test_sigterm_is_a_clean_save_with_preemption_and_a_loss_without",
    },
    "test_progress": {
        "test_a_bar_is_drawn_when_asked_and_tqdm_disable_silences_it",
        "test_a_loop_with_a_bar_trains_exactly_as_one_without",
    },
    "test_reproduce": {
        "test_a_run_writes_the_result_the_figure_and_every_epochs_error",
        "test_an_in_process_run_gives_ctrl_c_and_kill_back",
        "test_bad_arguments_get_one_line",
        "test_bf16_runs_in_bf16_and_resumes_to_the_same_bits",
        "test_ctrl_c_checkpoints_and_says_how_to_resume",
        "test_killed_at_random_points_and_resumed_it_ends_with_the_same_bits",
        "test_recorded_finds_the_newest_committed_run_and_every_epochs_error",
        "test_refuses_to_overwrite_or_to_mix_settings",
    },
    "test_slurm": {
        "test_a_job_runs_every_task_and_its_output_comes_back",
        "test_a_killed_rank_fails_the_job_with_its_reason",
        "test_a_requeued_job_resumes_to_the_same_bits",
        "test_one_and_two_tasks_train_the_same_model",
        "test_without_slurm_the_chapter_explains_itself_and_runs_to_the_end",
    },
    "test_speedrun": {
        "test_a_new_row_is_measured_and_tabled_without_other_edits",
        "test_the_chapters_ddp_worker_trains_a_row_on_two_ranks",
        "test_the_course_runner_gives_a_chapter_its_own_profile",
        "test_train_to_an_easy_target_and_not_to_an_impossible_one",
    },
    "test_timing": {
        "test_noise_watch_reads_load_and_the_reference_kernel",
        "test_timing_and_device_import_in_either_order_without_a_circle",
    },
    "test_toolflows": {
        "test_hls4ml_firmware_from_qonnx_equals_the_brevitas_model_bit_for_bit",
        "test_nncf_int8_runs_int8_kernels_and_keeps_the_argmax",
        "test_nncf_quantize_hands_rich_its_jupyter_setting_back",
        "test_openvino_fp32_equals_onnx_runtime_on_the_same_file_and_inputs",
        "test_the_chapters_script_converts_to_a_full_integer_model_that_keeps_the_argmax",
        "test_torchao_int4_quantizes_only_the_layers_its_cpu_kernel_takes",
        "test_torchao_int8_stays_close_to_fp32_and_leaves_the_original_alone",
    },
    "test_train": {
        "test_fit_matches_the_loop_written_out_and_records_each_epoch",
    },
    "test_xla": {
        "test_launch_demo_one_device_runs",
    },
}
SLOW_FIXTURES = {"test_parallel": {"jobs"}, "test_reproduce": {"straight", "straight_bf16"},
                 "test_slurm": {"cluster", "gpu_cluster"}}


# `make test` runs on two xdist workers, one file at a time each, in collection order (`--no-loadscope-reorder`:
# xdist would otherwise send the files with the most tests first): the longest files go first, so that the short ones
# fill the end and no worker is left alone with a long file. The seconds are each file's wall time on its worker in
# a fresh clone's `make test` on the 2-core machine (2026-12-02). A file not named here goes after these, in the usual
# order.
COST = {"test_fullbatch": 110, "test_course": 96, "06_distributed_data_parallel": 92, "11_speedrun": 77,
        "02_fullbatch_fast_loop": 76, "03_momentum_adam_one_cycle": 69, "test_parallel": 67, "test_reproduce": 67,
        "12_on_a_cluster": 64, "08_quantization_onnx_fpga": 56, "09_long_runs": 56, "test_slurm": 64,
        "05_input_pipeline": 48, "07_tpus_and_xla": 45, "test_worker_edits": 40, "test_longrun": 39,
        "10_deployment_toolflows": 35,
        "01_hardware_and_timing": 32, "test_browser": 31, "04_mixed_precision": 28, "test_toolflows": 16,
        "test_deploy": 16, "test_speedrun": 15, "test_checkpoint": 14, "test_peers": 11, "test_course_runner": 10,
        "test_precision": 10, "test_nonfinite": 10, "test_progress": 7, "test_oom": 7, "test_pipeline": 7,
        "test_xla": 6}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -COST.get(item.path.stem, 0))  # stable: a file's tests keep their order
    for item in items:
        name = getattr(item, "originalname", item.name)
        uses = set(getattr(item, "fixturenames", ())) & SLOW_FIXTURES.get(item.path.stem, set())
        if item.path.suffix == ".ipynb" or name in SLOW.get(item.path.stem, ()) or uses:
            item.add_marker(pytest.mark.slow)


@pytest.fixture()
def cli_here(capsys):
    """`cli_here(*args, env=None)`: the CLI's `main` in this process (exit status, stdout and stderr, as a
    CompletedProcess): for more error paths of a command once one has gone through `python -m accelhelpers` in a new
    process, without paying another interpreter and torch import for each."""
    import os
    import subprocess
    from unittest import mock

    from accelhelpers.__main__ import main

    def run(*args, env=None) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with mock.patch.dict(os.environ, env or {}):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --version, --help and its own usage errors
                code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


# --- one run of chapter 01, shared ------------------------------------------------------------------------------------
# The CLI test, the papermill-parameters test and the report test all read this one run (a course run through the
# CLI, with --param and small sizes), so `make test` executes chapter 01 here once, beside nbval's run and
# JupyterLab's. Under pytest-xdist every worker asks for it: the first makes it under a lock in the session's shared
# temporary folder, the others read it. JupyterLab's run (test_browser.py) uses the same small sizes; nbval runs the
# chapter's own.
CHAPTER_01_PARAMS = ["MATMUL_SIZES=[16, 32]", "ELEMENTWISE_MB=[0.03, 1]", "OVERHEAD_BATCHES=[1, 64]", "MIN_TIME=0.005",
                     "PEAK_RUNS=1"]


@pytest.fixture(scope="session")
def chapter_01_run(tmp_path_factory):
    """(out folder, returncode, stdout + stderr) of `course run --only 01 --param 'MATMUL_SIZES=[16, 32]' …`: small
    sizes (the chapter's own run is nbval's)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    out, done = shared / "chapter_01_run", shared / "chapter_01_run.json"
    with FileLock(str(shared / "chapter_01_run.lock")):
        if not done.exists():
            root = Path(__file__).resolve().parents[1]
            params = [arg for p in CHAPTER_01_PARAMS for arg in ("--param", p)]
            r = subprocess.run([sys.executable, "-m", "accelhelpers", "course", "run", "--only", "1", "--out", str(out),
                                *params], capture_output=True, text=True, cwd=root, timeout=600,
                               env={k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")})
            done.write_text(json.dumps({"returncode": r.returncode, "output": r.stdout + r.stderr}))
    record = json.loads(done.read_text())
    return out, record["returncode"], record["output"]


# --- a clock the test controls ------------------------------------------------------------------------------------
class FakeClock:
    """A clock the test controls: time moves only when a timed function says so (use exact binary fractions of a
    second, so sums compare exactly); every clock read, call and sync goes into `events`, in order."""

    def __init__(self, monkeypatch):
        self.now, self.events, self._mp = 0.0, [], monkeypatch

    def install(self, *modules) -> None:
        """Make `modules`' `time.perf_counter` this clock (each module's `import time`)."""
        for module in modules:
            self._mp.setattr(module, "time", self)

    def perf_counter(self) -> float:
        self.events.append("clock")
        return self.now

    def work(self, seconds: float, name: str = "call"):
        """A timed function that takes `seconds` of this clock."""
        def fn():
            self.events.append(name)
            self.now += seconds
        return fn

    def sync(self, device) -> None:
        self.events.append("sync")


@pytest.fixture()
def clock(monkeypatch):
    """Chapter 01's timing functions on a FakeClock (their `time.perf_counter` and `ah.timing.sync`); `clock.install`
    puts another module on it too."""
    from accelhelpers import timing

    fake = FakeClock(monkeypatch)
    fake.install(timing)
    monkeypatch.setattr(timing, "sync", fake.sync)
    return fake

