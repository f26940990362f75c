import fnmatch

import pytest
import torch

from swiglu_cupy.kernels.launch_config import using_launcher

from swiglu_cupy.kernels.host_exec import HostLauncher

DTYPES_ALL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "training: trains a model for hundreds of steps "
                                       "(the floor run of .ci/run leaves it out)")


# ---- test tiers (docs/testing.md#tiers) ---------------------------------------------------
# Every test carries exactly one tier marker; `python -m pytest -q -m TIER` runs one tier,
# plain `python -m pytest -q` runs them all. The tiers and what goes in each:
#   quick           every module's core behaviour, for every change (at most 3 minutes on 2 cores)
#   extended        the rest of the single-process tests: full matrices, CLI runs in subprocesses,
#                   torch.compile and export sweeps, long shapes
#   multiprocess    tests that start gloo ranks (torch.distributed, DeepSpeed, sharded libraries)
#   compile_matrix  NVRTC compiles of the kernels (the whole matrix in tests/test_compile_check.py)
#   peer_suites     a peer library's own test suite run on patched models (transformers' common tests)
#   training        trains a model for hundreds of steps (marked in the test file itself)
TIERS = ("quick", "extended", "multiprocess", "compile_matrix", "peer_suites", "training")

# Every test file, by file name, and the tier of its tests; a test named in TESTS below goes to
# the tier named there instead. tests/test_tiers.py checks that each test file is listed here.
FILES = {
    # the core: dense op, module, functions, validation, checkpointing, memory modes, primitives
    "test_api.py": "quick",
    "test_architecture.py": "quick",
    "test_checkpoint.py": "quick",
    "test_functions.py": "quick",
    "test_memory_modes.py": "quick",
    "test_module.py": "quick",
    "test_validation.py": "quick",
    "test_primitives.py": "quick",
    "test_dispatch.py": "quick",
    "test_hardening.py": "quick",
    "test_silu_mul.py": "quick",
    "test_ops.py": "quick",
    "test_transforms.py": "quick",
    "test_glu.py": "quick",
    "test_saved_x12_fp8.py": "quick",
    "test_tiles.py": "quick",
    "test_moe.py": "quick",
    "test_moe_tiles.py": "quick",
    # kernels: sources, launching, the self-check (host-executed, float32 only in quick: see below)
    "test_sources.py": "quick",
    "test_launch.py": "quick",
    "test_selfcheck.py": "quick",
    "test_host_exec.py": "extended",
    "test_compile_check.py": "compile_matrix",
    "test_machine_code.py": "compile_matrix",   # SASS of the NVRTC modules test_compile_check compiles
    "test_activation_math.py": "extended",       # the device math model over every 16-bit value (~35 s)
    "test_host_executor.py": "extended",         # the cooperative executor (a subprocess, a fiber build)
    "test_cuda.py": "extended",                  # marked gpu: skipped without one
    # integrations, single process
    "test_patch.py": "quick",
    "test_plan_runner.py": "quick",
    "test_hf.py": "quick",
    "test_hf_native.py": "quick",
    "test_peft.py": "quick",
    "test_xformers.py": "quick",
    "test_moe_hf.py": "extended",
    "test_training_libraries.py": "extended",
    "test_torchtitan.py": "extended",
    "test_timm.py": "extended",                  # timm's real models (skips without a usable timm)
    "test_fail_closed.py": "extended",
    "test_fail_closed_megatron.py": "multiprocess",
    "test_glu_source.py": "quick",               # the walk's safety net, and the reach scan on a planted library
    "test_reach.py": "extended",                 # the nine libraries' gated-unit classes (first run only: .ci/run)
    # tools, CLI, packaging, docs
    "test_public_api.py": "quick",
    "test_live_bytes.py": "quick",
    "test_host_cost.py": "quick",                # the CUDA route's host path on the CPU (~9 s, transformers' import)
    "test_bench_report.py": "quick",
    "test_bench_contenders.py": "quick",
    "test_bench_measure.py": "quick",
    "test_selftest.py": "quick",
    "test_torch_compat.py": "quick",
    "test_readme.py": "quick",
    "test_docs.py": "quick",
    "test_tiers.py": "quick",
    "test_bench_cli.py": "extended",
    "test_bench_sweep.py": "extended",
    "test_bench_compile_probe.py": "extended",
    "test_packaging.py": "extended",
    # gloo ranks
    "test_distributed.py": "multiprocess",
    "test_distributed_compat.py": "multiprocess",
    "test_parallel.py": "multiprocess",
    "test_hf_tp.py": "multiprocess",
    "test_deepspeed.py": "multiprocess",
    "test_deepspeed_families.py": "multiprocess",
    "test_deepspeed_trainer.py": "multiprocess",
    "test_training_libraries_sharded.py": "multiprocess",
    "test_megatron.py": "multiprocess",
    # peers' own suites, training runs
    "test_hf_common.py": "peer_suites",
    "test_fp8_convergence.py": "training",
}

# Tests outside their file's tier: file name -> {test: tier}. A test is its function name (all of
# its cases), or the name and a pattern of the case's parameter id: "test_x[llama-*]" (fnmatch).
TESTS = {
    "test_api.py": {"test_silu_mul_on_dtensors_is_shard_by_shard": "multiprocess"},
    # Host-executed in another dtype than float32 (each dtype is a g++ build): extended.
    "test_hardening.py": {"test_property_host_kernels_match_reference": "extended",
                          "test_index_range_beyond_2_pow_31_on_host": "extended",
                          "test_backward_is_bitwise_deterministic[host_kernels]": "extended",
                          "test_tiny_and_odd_sizes[host_kernels-*]": "extended"},
    "test_selfcheck.py": {"test_a_correct_module_passes_once_and_its_probe_covers_the_shapes": "extended",
                          "test_a_wrong_fp8_saved_x12_kernel_is_caught_and_replaced": "extended",
                          "test_info_lists_each_module_with_its_result": "extended",
                          "test_moe_check_under_autocast_and_inference_mode_is_not_fooled": "extended",
                          "test_a_limit_beyond_the_dtype_range_is_probed_at_its_largest_value": "extended"},
    "test_silu_mul.py": {"test_torch_compile_and_opcheck": "extended"},
    "test_validation.py": {"test_tensor_subclass_weight_does_not_import_torch_distributed": "extended"},
    "test_public_api.py": {"test_the_cli_lists_its_commands": "extended"},
    "test_docs.py": {"test_python_block_runs_on_the_cpu": "extended"},   # every page's blocks, one process
    "test_ops.py": {"test_torch_compile_memory_modes": "extended"},
    "test_transforms.py": {"test_export_save_load_round_trip_in_a_fresh_process": "extended",
                           "test_onnx_export_uses_standard_ops_and_matches_onnxruntime": "extended",
                           "test_run_decompositions_default_and_to_plain_aten": "extended",
                           "test_export_runs_and_matches_eager[functional-*]": "extended"},
    "test_glu.py": {"test_torch_compile_fullgraph_every_layout": "extended",
                    "test_clamp_boundaries_pass_the_gradient_like_torch_clamp[*host_kernels]": "extended",
                    "test_onnx_export_of_the_variants_uses_standard_ops": "extended"},
    "test_saved_x12_fp8.py": {"test_torch_compile_fullgraph_matches_eager": "extended",
                              "test_kernel_encoder_is_bit_exact_with_torchs_cast_on_every_bf16_value": "extended",
                              "test_float64_builds_no_8_bit_kernels_and_their_launch_says_why": "extended",
                              "test_moe_torch_compile_fullgraph_matches_eager": "extended"},
    "test_tiles.py": {"test_the_issue_goal_shape_memory": "extended",
                      "test_torch_compile_of_a_tiled_block_has_no_graph_break": "extended",
                      "test_tiled_bf16_grads_accumulate_in_fp32_within_one_rounding": "extended",
                      "test_tiles_peak_at_most_deepspeed_tiled_mlp_with_as_many_tiles": "extended",
                      "test_fsdp2_and_ddp_with_tiles_match_the_untiled_single_process_run": "multiprocess"},
    "test_moe.py": {"test_torch_compile_fullgraph_matches_eager": "extended",
                    "test_gradcheck_float64": "extended",
                    "test_clamp_gradient_at_exactly_the_limit_follows_the_rule_in_force[*host_kernels]": "extended",
                    "test_opcheck_registered_ops": "extended",
                    "test_unpacked_opcheck_registered_ops": "extended",
                    "test_unpacked_matches_fp64_reference_and_packed[recompute_gate_up-*]": "extended",
                    "test_unpacked_matches_fp64_reference_and_packed[tiles-*]": "extended",
                    "test_unpacked_matches_fp64_reference_and_packed[fp8_saved_x12-*]": "extended",
                    "test_unpacked_torch_compile_fullgraph_matches_eager": "extended",
                    "test_fsdp2_two_ranks_matches_one_process": "multiprocess"},
    "test_moe_tiles.py": {"test_torch_compile_of_tiled_experts_has_no_graph_break": "extended",
                          "test_bf16_tiles_sum_weight_gradients_in_fp32": "extended"},
    "test_launch.py": {"test_info_command_explains_the_state": "extended",
                       "test_eight_threads_first_call_compile_once_and_compute_correctly": "extended"},
    "test_host_exec.py": {"test_kernels_match_torch_implementation": "quick",
                          "test_vector_path_when_aligned_scalar_path_otherwise": "quick",
                          "test_strided_rows_and_in_place_outputs": "quick",
                          "test_rows_beyond_the_grid_are_covered_by_the_row_loop": "quick",
                          "test_empty_batch_launches_nothing": "quick",
                          "test_whole_function_with_host_kernels": "quick",
                          "test_silu_mul_kernels_match_torch_implementation": "quick",
                          "test_silu_mul_in_place": "quick",
                          "test_default_launch_shape": "quick"},
    "test_compile_check.py": {"test_parse_ptxas_log": "quick",
                              "test_launch_candidates_only_use_compiled_instances_and_block_sizes": "quick"},
    "test_machine_code.py": {name: "quick" for name in (   # the SASS parser and walk on small inputs
        "test_every_known_failure_names_a_real_kernel", "test_parse_instructions",
        "test_structure_of_parsed_function", "test_sm80_loop_exit_call_is_a_jump_not_a_call",
        "test_parse_param_layout", "test_walk_runs_loops_by_their_counter_and_takes_the_fast_path",
        "test_integer_semantics", "test_driver_constants_by_arch")},
    "test_patch.py": {"test_every_entry_reaches_in_random_nests_of_containers_and_blocks_what_patch_reaches":
                      "extended",
                      "test_hf_family_parity_with_checkpointing[gemma2]": "extended",
                      "test_hf_family_parity_with_checkpointing[deepseek_v4]": "extended",
                      "test_class_level_patching[deepseek_v4]": "extended",
                      "test_hf_family_parity_with_checkpointing[gemma3_text]": "extended",
                      "test_hf_family_parity_with_checkpointing[glm]": "extended",
                      "test_hf_family_parity_with_checkpointing[glm4]": "extended",
                      "test_patch_of_a_model_without_experts_does_not_import_transformers": "extended",
                      "test_hf_family_bf16_error_no_larger_than_unpatched": "extended"},
    "test_hf.py": {"test_convergence_parity": "extended",
                   "test_other_known_activations_fused": "extended",
                   "test_parity_logits_and_grads[mistral-*]": "extended",
                   "test_parity_logits_and_grads[qwen2-*]": "extended",
                   "test_save_pretrained_roundtrip[qwen2]": "extended"},
    "test_hf_native.py": {"test_export_then_onnx_under_no_grad_matches_onnxruntime": "extended",
                          "test_export_decompositions_leave_no_swiglu_op": "extended"},
    "test_peft.py": {"test_thirty_training_steps_match": "extended"},
    "test_fail_closed.py": {"test_hf_experts_under_transformers_expert_parallel_are_checked_on_their_shards":
                            "multiprocess"},
    "test_xformers.py": {"test_import_does_not_import_xformers": "extended",
                         "test_fsdp2_two_gloo_ranks_against_one_process": "multiprocess"},
    "test_moe_hf.py": {"test_registered_under_swiglu_cupy": "quick",
                       "test_plans_map_each_family_to_its_activation": "quick",
                       "test_logits_and_every_gradient_match_hf_eager_and_grouped_mm[mixtral-non_reentrant]": "quick",
                       "test_logits_and_every_gradient_match_hf_eager_and_grouped_mm[gpt_oss-None]": "quick",
                       "test_saved_bytes_each_tokens_input_once[mixtral-tiny_top2]": "quick",
                       "test_from_pretrained_with_experts_implementation": "quick",
                       "test_patch_model_and_patch_switch_the_experts_too": "quick",
                       "test_unknown_gate_or_ungated_expert_is_left_unfused_with_a_warning": "quick",
                       "test_expert_parallel_sentinels_match_hf": "quick"},
    "test_training_libraries.py": {
        "test_torchtune_feed_forwards_are_fused_whole_with_parity[llama3-checkpointed]": "quick",
        "test_olmo_core_feed_forwards_are_fused_whole_with_parity[llama_silu-checkpointed]": "quick"},
    "test_torchtitan.py": {"test_torchtitan_parallelize_two_gloo_ranks": "multiprocess"},
    "test_bench_measure.py": {"test_cpu_path_record_per_dtype_and_case": "extended",
                              "test_overhead_record_has_both_modes_and_ratios_to_eager_hf": "extended"},
    "test_bench_cli.py": {"test_resolve_*": "quick"},
    "test_host_cost.py": {"test_bench_host_cost_quick_prints_every_entry_point_on_both_routes": "extended"},
    "test_bench_sweep.py": {"test_no_recommendation_without_the_default": "quick",
                            "test_estimate_counts_every_timing_and_follows_its_model": "quick"},
    "test_selftest.py": {"test_without_cuda_exits_2_and_runs_nothing": "extended",
                         "test_step_limit_stops_the_whole_process_group": "extended"},
    "test_torch_compat.py": {"test_torch_compile_under_the_ci_environment_variable": "extended",
                             "test_a_torch_without_the_cpp_apply_still_imports_and_runs": "extended"},
    "test_tiers.py": {"test_quick_tier_runs_without_the_optional_packages": "extended"},
}


def tier_of(item) -> str:
    """The tier of one collected test (see TIERS)."""
    if item.get_closest_marker("training") is not None:
        return "training"
    file = item.path.name
    tier = FILES.get(file, "extended")
    case = getattr(getattr(item, "callspec", None), "id", "")
    for pattern, named in TESTS.get(file, {}).items():
        name, _, params = pattern.partition("[")
        if fnmatch.fnmatchcase(item.originalname, name) and (not params or fnmatch.fnmatchcase(case, params[:-1])):
            tier = named
    if tier == "quick" and "host_launcher" in getattr(item, "fixturenames", ()):
        # Host execution builds one library per dtype with g++ (tens of seconds each on a
        # cold cache): the quick tier runs the host-executed cases in float32 only.
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, torch.dtype) and v != torch.float32 for v in params.values()):
            tier = "extended"
    return tier


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def host_launcher(request):
    """Runs the kernels_cu sources on the CPU (built once per session). The
    libraries of all dtypes are built up front, in parallel, unless only
    quick-tier tests use the launcher: those build what they run (float32)."""
    launcher = HostLauncher()
    users = [item for item in request.session.items if "host_launcher" in getattr(item, "fixturenames", ())]
    if any(item.get_closest_marker("quick") is None for item in users):
        launcher.warm(DTYPES_ALL)
    return launcher


def primitives_on_host_kernels(launcher):
    """Route every primitive call (CPU tensors included) through the kernel
    path with ``launcher``: the whole Function then runs the .cu kernels."""
    return using_launcher(launcher)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / ||expected||_rms, in float64."""
    a, e = actual.double(), expected.double()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def zero_filled_shapes(fn) -> list:
    """The shapes of the tensors zero-filled (``aten::zero_``/``fill_``) while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [tuple(e.input_shapes[0]) for e in prof.events()
            if e.name in ("aten::zero_", "aten::fill_") and e.input_shapes and e.input_shapes[0]]


def assert_nontrivial(grad: torch.Tensor, name: str) -> None:
    assert grad is not None, f"{name}: gradient is None"
    assert torch.isfinite(grad).all(), f"{name}: non-finite gradient"
    assert grad.double().abs().max().item() > 0, f"{name}: gradient is all zeros"


def routed_saved_bytes(T, K, E, D, I, x_bytes, rw_bytes, recompute_gate_up=False) -> int:
    """Bytes the routed MoE path saves for backward (issue 26): each token's
    input once (T*D), x12 per routed row (S*2I; none with
    recompute_gate_up), the expert order ``perm`` (int32) and the routing
    weights per routed row, and the offsets (E int32)."""
    S = T * K
    return T * D * x_bytes + (0 if recompute_gate_up else S * 2 * I * x_bytes) + S * (4 + rw_bytes) + E * 4


def routed_saved_bytes_a6d6350(T, K, E, D, I, x_bytes, rw_bytes, recompute_gate_up=False) -> int:
    """What the routed path saved before issue 26 (commit a6d6350; these
    reproduce its measured figures, docs/moe.md): x_sorted per routed row (K
    copies of each token's input), x12, three int64 index vectors (perm,
    inverse, token), the gathered routing weights, the offsets."""
    S = T * K
    return S * (D + (0 if recompute_gate_up else 2 * I)) * x_bytes + S * (3 * 8 + rw_bytes) + E * 4


def routed_saved_ratio_goal(K, D, I) -> float:
    """Issue 26's bound on saved bytes, new / before: (D + K*2I) / (K*(D + 2I))."""
    return (D + K * 2 * I) / (K * (D + 2 * I))


def swiglu_fp64_reference(x, w12, b12, w3, b3):
    """Independent eager reference, computed in float64 from the given values."""
    import torch.nn.functional as F

    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    H = w12.shape[0] // 2
    x12 = F.linear(d(x), d(w12), d(b12))
    h = F.silu(x12[..., :H]) * x12[..., H:]
    return F.linear(h, d(w3), d(b3))


# Half an ulp at 1.0 for each storage dtype (one rounding, relative).
UNIT_ROUNDOFF = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24, torch.float64: 2**-53}


def elementwise_error_bounds(x12: torch.Tensor, dh: torch.Tensor, exact_h, exact_dx12):
    """Per-element error bounds for h and dx12 of a single-rounding
    implementation: one storage ulp of the exact value, plus a few ulps of the
    math dtype (fp32, or fp64 for float64) times the size of the terms, since
    dgate = dh*u*s*(1 + g*(1-s)) cancels near g = -1.28."""
    dtype = x12.dtype
    ulp = 2 * UNIT_ROUNDOFF[dtype]
    math_eps = 8 * UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    g, u = x12.double().chunk(2, dim=1)
    d = dh.double()
    tiny = torch.finfo(dtype).tiny
    h_terms = (g * u).abs()
    dx12_terms = torch.cat([(d * u).abs() * (1 + g.abs()), (d * g).abs()], dim=1)
    h_bound = exact_h.double().abs() * ulp + h_terms * math_eps + tiny
    dx12_bound = exact_dx12.double().abs() * ulp + dx12_terms * math_eps + tiny
    return h_bound, dx12_bound


def spec_of_variant(variant):
    """A spec that runs ``variant``: the limit cuts a good share of x12 ~ N(0, 2^2)."""
    from swiglu_cupy.activations import GLUActivation

    oai = dict(alpha=1.702, up_offset=1.0) if variant.kind == "oai" else {}
    return GLUActivation(variant.kind, limit=1.5 if variant.clamp else None, interleaved=variant.interleaved, **oai)


def glu_error_bounds(x12, dh, spec, ref_h, ref_dx12):
    """Per-element bounds between two single-rounding implementations of a
    variant (``reference.single_rounding_bounds``: one storage ulp of the
    value plus a few math-dtype ulps of the size of its terms), sized from the
    raw (unclamped) gate and up."""
    from swiglu_cupy.reference import single_rounding_bounds

    return single_rounding_bounds(x12, dh, spec, ref_h, ref_dx12, clamp=False)


def assert_compiled_matches_eager(model, x, tol):
    """torch.compile(fullgraph=True) traces with no graph break and matches
    eager, forward and every gradient. Returns the eager output."""
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.pow(2).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    y_eager = model(x)
    y_eager.pow(2).sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=tol, atol=tol)  # same ops, maybe fused differently
    for g, p in zip(grads, [x] + list(model.parameters())):
        assert_nontrivial(g, "compiled grad")
        torch.testing.assert_close(g, p.grad, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), y_eager, rtol=tol, atol=tol)
    return y_eager


def onnx_run_with_standard_ops(model, x, tmp_path):
    """``torch.onnx.export(model, (x,), dynamo=True)``, saved and run by ONNX
    Runtime; asserts the graph uses standard ONNX domains only (no custom op
    of ours). Returns ORT's output as a torch tensor."""
    ort = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(model, (x,), dynamo=True)
    path = tmp_path / "model.onnx"
    program.save(str(path))
    domains = {node.domain for node in program.model_proto.graph.node}
    for function in program.model_proto.functions:
        domains |= {node.domain for node in function.node}
    assert domains <= {"", "ai.onnx"}, domains
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(out)


@pytest.fixture(params=[True, False], ids=["grad_at_bound", "no_grad_at_bound"])
def clamp_rule(request, monkeypatch):
    """Each torch's clamp rule in turn, whatever torch is installed: True
    (up to 2.13) passes the gradient at exactly the limit, False (2.14 on)
    gives it 0. Compare against ``glu_reference(...,
    clamp_gradient_at_bound=clamp_rule)``."""
    from swiglu_cupy import _torch_compat

    monkeypatch.setattr(_torch_compat, "CLAMP_GRADIENT_AT_BOUND", request.param)
    return request.param
