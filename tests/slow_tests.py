"""The tests `pytest -m "not slow"` leaves out: a contributor's first run on 2 cores finishes in
minutes, and CI (`.ci/run`) still runs them all. Chosen from one full run's --durations on the
busy 2-core machine (15 min 48 s, 1092 passed): every test function whose calls took 2.5 s or
more, its parametrizations together (the figures: that run's setup + call + teardown, per
file), and the SmolLM2 start-up interruption test (4 starts, ~30 s). Named here in one place
(tests/conftest.py marks them) rather than by a decorator in each file; a name that no longer
matches a test fails tests/test_slow_tests.py."""

_BY_FILE = {
    "tests/builder/test_build.py": (  # 4 s
        "test_smollm2_gguf_builds_an_engine_that_answers_as_the_gguf",
    ),
    "tests/builder/test_build_fp4.py": (  # 24 s
        "test_an_fp4_checkpoint_builds_the_fp8_engine_loading_it_runs",
    ),
    "tests/builder/test_build_int4.py": (  # 53 s
        "test_an_int4_build_loads_as_int4_and_runs_close_to_its_source",
    ),
    "tests/checkpoint/test_loaders.py": (  # 8 s
        "test_smollm2_tensors_equal_transformers_gguf_load",
    ),
    "tests/distributed/test_parallel.py": (  # 29 s
        "TestQwen2TP2::test_a_hung_rank_ends_the_engine_within_the_timeout",
        "TestQwen2TP2::test_idle_longer_than_the_timeout_is_fine",
        "test_a_float8_head_in_parallel_equals_one_process",
        "test_smollm2_at_tp3_equals_one_process",
        "test_two_torchrun_nodes_on_localhost_give_the_same_tokens",
    ),
    "tests/engine/test_batch_invariance.py": (  # 167 s
        "test_async_scheduling_gives_the_same_tokens",
        "test_async_scheduling_matches_synchronous_for_every_sampling_feature",
        "test_batch_of_32_mixed_lengths",
        "test_preemption_under_tiny_kv_pool",
        "test_prefix_cache_hits_do_not_change_outputs",
        "test_tiny_chunked_prefill_budget",
    ),
    "tests/engine_core/test_engine_process.py": (  # 18 s
        "test_an_engine_that_cannot_start_says_why",
        "test_disconnect_frees_blocks_then_a_dead_engine_process_ends_the_server",
    ),
    "tests/eval/test_eval.py": (  # 3 s
        "test_gsm8k_run_on_smollm2",
    ),
    "tests/kernels/test_fp8_reciprocal.py": (  # 7 s
        "test_fused_silu_mul_quant_equals_the_unfused_kernels_at_every_bf16_gate",
    ),
    "tests/kernels/test_triton_kernels.py": (  # 29 s
        "test_decode_attention",
        "test_decode_attention_fp8_cache",
        "test_decode_attention_graph_grid_mixed_lengths",
        "test_decode_attention_packed",
    ),
    "tests/layers/test_fp8_linear.py": (  # 5 s
        "test_fp8_add_rms_norm_linear_and_silu_mul",
    ),
    "tests/layers/test_outlier_columns.py": (  # 11 s
        "test_outlier_engines_at_tp2_equal_one_process",
        "test_the_quantizing_kernels_write_the_reference_remainders",
    ),
    "tests/models/test_long_context.py": (  # 32 s
        "test_long_prompt_chunked_equals_hf_and_one_chunk",
    ),
    "tests/models/test_smollm2_vs_hf.py": (  # 34 s
        "test_greedy_matches_hf_on_8_prompts",
        "test_stream_equals_generate",
    ),
    "tests/runtime/test_kv_cache_fp8.py": (  # 47 s
        "test_fp8_batched_chunked_preempted_prefix_cached_stay_within_quantization_noise",
        "test_fp8_prefix_hit_attends_over_the_bytes_written_before",
        "test_fp8_prompt_logprobs_close_to_the_unquantized_cache",
        "test_fp8_same_requests_on_a_cold_cache_reproduce",
    ),
    "tests/server/test_api_servers.py": (  # 100 s
        "test_a_dead_engine_ends_streams_in_every_api_process_and_the_server",
        "test_an_engine_that_cannot_start_says_why_once",
        "test_disconnects_in_every_api_process_free_kv_and_metrics_count_them_all",
        "test_sigterm_drains_every_api_process_then_exits_0",
    ),
    "tests/server/test_defects.py": (  # 4 s
        "test_metrics_answer_at_once_from_the_last_step_during_a_long_step",
    ),
    "tests/server/test_fuzz.py": (  # 75 s
        "test_no_server_errors",
    ),
    "tests/server/test_lifecycle.py": (  # 78 s
        "test_drain_deadline_aborts_the_rest_then_exits_0",
        "test_sigterm_drains_in_flight_requests_then_exits_0",
    ),
    "tests/server/test_lm_eval.py": (  # 27 s
        "test_local_chat_completions_generation",
        "test_local_completions_generation_choices_and_rolling",
    ),
    "tests/server/test_lora_serving.py": (  # two kiln serve processes, ~60 s of starting
        "test_kiln_serve_with_the_engine_process",
    ),
    "tests/server/test_openai_api.py": (  # 37 s
        "test_64_concurrent_streams_equal_alone",
        "test_completions_equal_offline",
        "test_disconnect_aborts_and_frees_kv",
        "test_n_seed_and_stop_equal_offline",
    ),
    "tests/spec_decode/test_eagle3.py": (  # 13 s
        "test_eagle3_greedy_is_exact",
        "test_smollm2_eagle3_greedy_is_exact",
    ),
    "tests/spec_decode/test_spec_decode.py": (  # 12 s
        "test_smollm2_ngram_and_truncated_draft_are_exact",
    ),
    "tests/structured_output/test_structured_output.py": (  # 7 s
        "test_requests_aborted_and_preempted_while_a_fill_runs",
        "test_smollm2_json_schema",
    ),
    "tests/test_dockerfile.py": (  # 3 s
        "test_pip_lines_name_packages_the_index_has",
    ),
    "tests/test_llm.py": (  # 50 s
        "test_cli_generate_prompts_file",
        "test_n_completions_and_seeds",
        "test_stop_strings_never_leak",
        "test_stop_token_ids_and_min_tokens",
        "test_stream_takes_every_prompt_form",
    ),
    "tests/test_typecheck.py": (  # 6 s
        "test_mypy_clean",
    ),
    # LoRA: engines and HF + PEFT oracles on tiny models; test_each_adapter_alone_matches_hf,
    # the bad adapters, the slots and the layers stay in the fast subset.
    "tests/lora/test_lora_vs_hf.py": (
        "test_three_adapters_and_the_base_in_one_batch",
        "test_unload_and_reload",
        "test_an_adapter_in_use_is_not_removed",
        "test_more_adapters_than_slots",
        "test_decode_graphs_pad_with_no_adapter",
        "test_prefix_cache_is_keyed_by_adapter",
        "test_fp8_base",
        "test_chunked_and_preempted",
        "test_folded_kv_cache_scales",
        "test_granite_multipliers",
    ),
    "tests/lora/test_lora_parallel.py": ("test_parallel_lora_equals_hf",),
    "tests/lora/test_async_engine.py": ("test_async_engine_serves_adapters",),
    "tests/cli/test_generate_lora.py": ("test_generate_with_an_adapter",),
    "tests/engine_core/test_startup_interruption.py": (  # 30 s
        "test_the_engine_process_goes_with_its_parent_at_any_stage",
    ),
}

# "path::name" (a class's tests: "path::Class::name"), as pytest's node ids without parameters.
SLOW_TESTS = frozenset(f"{path}::{name}" for path, names in _BY_FILE.items() for name in names)
