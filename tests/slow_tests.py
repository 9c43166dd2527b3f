"""The tests `pytest -m "not slow"` leaves out: a contributor's first run on 2 cores finishes in
minutes, and CI (`.ci/run`) still runs them all. Chosen from one full run's --durations on the
busy 2-core machine (15 min 48 s, 1092 passed): every test function whose calls took 2.5 s or
more, its parametrizations together (the figures: that run's setup + call + teardown, per
file), and the SmolLM2 start-up interruption test (4 starts, ~30 s). Named here in one place
(tests/conftest.py marks them) rather than by a decorator in each file; a name that no longer
matches a test fails tests/test_slow_tests.py."""

_BY_FILE = {
    "tests/bench/test_kernels_gpu_smoke.py": (  # 35 s: two interpreted benchmark runs
        "test_the_tiny_run_writes_every_row",
    ),
    "tests/bench/test_kv_occupancy.py": (  # 5 s: two tiny Gemma 3 engines
        "test_as_many_long_sequences_ran_at_once_as_the_plan_fits",
    ),
    "tests/builder/test_build.py": (  # 4 s
        "test_smollm2_gguf_builds_an_engine_that_answers_as_the_gguf",
    ),
    "tests/builder/test_build_fp4.py": (  # 24 s
        "test_an_fp4_checkpoint_builds_the_fp8_engine_loading_it_runs",
    ),
    "tests/builder/test_build_int4.py": (  # 53 s; the relaid build's two builds 7 s
        "test_an_int4_build_loads_as_int4_and_runs_close_to_its_source",
        "test_a_build_on_the_relaid_path_writes_the_same_engine",
    ),
    "tests/builder/test_build_int8_kv.py": (  # 12 s
        "test_an_int8_kv_build_stores_and_folds_per_head_scales",
    ),
    "tests/checkpoint/test_loaders.py": (  # 8 s
        "test_smollm2_tensors_equal_transformers_gguf_load",
    ),
    "tests/checkpoint/test_moe_fp8_checkpoints.py": (  # 12 s: 3 engines, transformers' oracle
        "test_fp8_block_experts_from_llm_compressor",
        "test_per_channel_experts_from_llm_compressor",
        "test_an_engine_built_from_it_keeps_per_channel_experts",
    ),
    "tests/distributed/test_moe_parallel.py": (  # 68 s: 10 two-rank engines
        "test_two_ranks_equal_hf",
    ),
    "tests/distributed/test_moe_fp8_block_parallel.py": (  # 19 s: 2 two-rank engines
        "test_two_ranks_equal_hf_dequantized",
    ),
    "tests/distributed/test_quantized_parallel.py": (  # 75 s: 8 two-rank engines, 16-bit loads
        "test_tp2_greedy_tokens_equal_one_process",
        "test_16_bit_weights_are_rounded_whole_then_cut",
        "test_a_checkpoints_ranks_compute_one_processs_products",
        "test_an_engines_whole_tensors_cut_as_the_checkpoints",
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
    "tests/engine_core/test_engine_process.py": (  # 18 s, and 11 s of one engine's build
        "test_an_engine_that_cannot_start_says_why",
        "test_disconnect_frees_blocks_then_a_dead_engine_process_ends_the_server",
        "test_every_api_process_sees_work_before_a_step_out_of_idle_wedges",
    ),
    "tests/eval/test_eval.py": (  # 3 s
        "test_gsm8k_run_on_smollm2",
    ),
    "tests/kernels/test_fp8_reciprocal.py": (  # 7 s
        "test_fused_silu_mul_quant_equals_the_unfused_kernels_at_every_bf16_gate",
    ),
    "tests/kernels/test_moe_fp8_block.py": (  # 24 s: interpreted block GEMMs
        "test_block_grouped_gemm_equals_its_twin",
        "test_the_gpus_tiles_equal_the_twin",
        "test_decode_reads_block_scales_as_its_twin",
    ),
    "tests/kernels/test_moe_w8a16.py": (  # 20 s: interpreted int8 GEMVs, block-scaled too
        "test_int8_decode_kernels_equal_their_twin",
        "test_grouped_int8_decode_kernels_equal_their_twin",
    ),
    "tests/kernels/test_moe_int4.py": (  # 14 s: interpreted INT4 decode GEMVs
        "test_int4_decode_kernels_equal_their_twin",
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
    "tests/layers/test_moe_fp8_block_parallel.py": (  # 50 s: 11 models, 2 builds
        "test_tensor_ranks_hold_rows_and_whole_input_blocks",
        "test_an_engine_directory_is_cut_as_the_checkpoint",
        "test_a_full_precision_checkpoint_rounds_each_expert_whole_before_the_cut",
    ),
    "tests/layers/test_outlier_columns.py": (  # 11 s
        "test_outlier_engines_at_tp2_equal_one_process",
        "test_the_quantizing_kernels_write_the_reference_remainders",
    ),
    "tests/models/test_moe_fp8_block.py": (  # 17 s: 4 engines, a build, transformers' oracle
        "test_the_fp8_release_format_equals_hf_dequantized",
        "test_a_quantized_router_is_widened",
        "test_fp8_block_quantizes_the_experts_of_a_full_precision_checkpoint",
        "test_a_mixtral_release_with_one_block_per_expert",
    ),
    "tests/models/test_moe_w8a16.py": (  # 5 s: the first's transformers oracle
        "test_llm_compressors_int8_moe_checkpoint",
    ),
    "tests/models/test_moe_int4.py": (  # 14 s: 5 INT4 checkpoints, transformers' oracle
        "test_int4_moe_checkpoint_generates_the_dequantized_models_tokens",
    ),
    "tests/models/test_deepseek_triton.py": (  # 28 s, 55 s: MLA through the interpreted kernels
        "test_triton_mla_equals_hf",
        "test_a_float8_cache_decodes_in_the_mla_kernel",
    ),
    "tests/models/test_long_context.py": (  # 32 s
        "test_long_prompt_chunked_equals_hf_and_one_chunk",
    ),
    "tests/models/test_smollm2_vs_hf.py": (  # 34 s
        "test_greedy_matches_hf_on_8_prompts",
        "test_stream_equals_generate",
    ),
    "tests/runtime/test_kv_cache_int8.py": (  # 35 s
        "test_int8_cache_holds_four_times_the_fp32_tokens",
        "test_int8_prompt_logprobs_close_to_the_unquantized_cache",
        "test_measured_scales_hold_keys_far_past_127",
    ),
    "tests/runtime/test_kv_cache_fp8.py": (  # 47 s
        "test_fp8_batched_chunked_preempted_prefix_cached_stay_within_quantization_noise",
        "test_fp8_prefix_hit_attends_over_the_bytes_written_before",
        "test_fp8_prompt_logprobs_close_to_the_unquantized_cache",
        "test_fp8_same_requests_on_a_cold_cache_reproduce",
    ),
    "tests/server/test_api_servers.py": (  # 100 s, and 20 s of the Responses store's server
        "test_a_dead_engine_ends_streams_in_every_api_process_and_the_server",
        "test_an_engine_that_cannot_start_says_why_once",
        "test_disconnects_in_every_api_process_free_kv_and_metrics_count_them_all",
        "test_sigterm_drains_every_api_process_then_exits_0",
        "test_stored_responses_are_shared_by_every_api_process",
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

# The fast subset's next-longest calls (1.4 s or more each in one --durations run of it on the
# 2-core machine, 8 min 35 s in all), per file with that run's total.
_FAST_RUN_TRIM = {
    "tests/bench/test_bench.py": (  # 2 s
        "test_bench_kv_cache_dtype_flag_reaches_the_engine_and_the_roofline",
    ),
    "tests/builder/test_build.py": (  # 15 s
        "test_a_build_within_the_limit_is_written_and_reuses_the_sources_perplexity",
        "test_every_long_step_of_a_checked_build_shows_a_progress_bar",
        "test_a_build_over_the_perplexity_limit_fails_with_its_numbers_and_keeps_it_rejected",
        "test_an_engine_runs_with_the_kv_cache_dtype_and_context_it_was_built_for",
        "test_an_engine_without_a_tokenizer_loads_without_importing_transformers",
        "test_an_fp8_dynamic_engine_generates_what_the_quantized_source_does",
    ),
    "tests/builder/test_build_eight_bit.py": (  # 8 s
        "test_a_block_fp8_engine_is_the_checkpoint_rounded_as_it_loads",
        "test_a_weight_only_engine_holds_the_rounded_weights",
        "test_smoothing_brings_the_int8_error_of_outlier_channels_down",
    ),
    "tests/builder/test_build_lora.py": (  # 2 s
        "test_the_accuracy_check_measures_against_the_merged_model",
    ),
    "tests/builder/test_build_prequantized.py": (  # 7 s
        "test_a_float8_cache_the_checkpoint_has_no_scales_for",
        "test_modelopt_kv_scales_are_the_engines_and_apply_to_a_float8_cache",
    ),
    "tests/builder/test_build_prequantized_int.py": (  # 16 s: 6 accuracy-checked builds
        "test_a_float8_cache_calibrates_as_for_an_fp8_checkpoint",
        "test_an_int8_cache_measures_its_scales_at_load_as_the_checkpoint_does",
        "test_the_accuracy_check_compares_the_engine_with_the_checkpoint",
    ),
    "tests/builder/test_gptq.py": (  # 2 s
        "test_a_gptq_build_loads_answers_and_is_its_own_engine",
    ),
    "tests/builder/test_gptq_sequential.py": (  # 7 s
        "test_the_sequential_roundings_parameters_name_the_engine",
        "test_a_tp2_sequential_build_is_the_tp1_engines_cut",
    ),
    "tests/builder/test_smoothing.py": (  # 4 s
        "test_unquantized_layers_stay_in_the_model_dtype_and_load_so",
        "test_smoothing_brings_the_fp8_error_of_outlier_channels_down",
    ),
    "tests/checkpoint/test_engine_manifest.py": (  # 2 s
        "test_kiln_generate_says_it_in_one_line_and_exits_2",
    ),
    "tests/checkpoint/test_gguf_fast_paths.py": (  # 3 s
        "test_the_embedded_tokenizer_skips_transformers_gguf_tables",
    ),
    "tests/checkpoint/test_int4_checkpoints.py": (  # 2 s
        "test_int4_checkpoint_generates_the_dequantized_models_tokens",
    ),
    "tests/distributed/test_parallel.py": (  # 2 s
        "TestLlamaTP2::test_a_second_parallel_engine_in_the_process_is_refused",
    ),
    "tests/engine_core/test_engine_process.py": (  # 18 s
        "test_second_sigterm_still_ends_streams_with_done",
        "test_another_process_of_the_user_can_neither_take_requests_nor_kill_the_client",
    ),
    "tests/kernel_cache/test_triton_cache.py": (  # 2 s
        "test_the_build_warm_up_runs_an_engine",
    ),
    "tests/kernels/test_attention_kinds.py": (  # 7 s
        "test_decode_kernel",
    ),
    "tests/kernels/test_triton_kernels.py": (  # 5 s
        "test_prefill_attention_fp8_qk",
    ),
    "tests/layers/test_eight_bit_linear.py": (  # 7 s; the engine runs 21 s
        "test_each_projection_through_triton_equals_the_reference",
        "test_triton_forward_equals_the_reference",
        "test_int8_activations_quantized_by_the_op_before_give_the_unfused_tokens",
    ),
    "tests/layers/test_fp8_linear.py": (  # 5 s
        "test_smollm2_fp8_dynamic_prompt_logprobs_close_to_fp32",
    ),
    "tests/layers/test_outlier_columns.py": (  # 2 s
        "test_a_static_engine_with_outlier_columns_is_closer_to_its_source",
    ),
    "tests/models/test_gemma.py": (  # 2 s
        "test_an_fp8_build_loads_and_stays_close",
    ),
    "tests/models/test_models_vs_hf.py": (  # 2 s
        "test_dummy_weights_from_preset",
    ),
    "tests/models/test_olmo2.py": (  # 2 s
        "test_an_fp8_build_loads_and_stays_close",
    ),
    "tests/models/test_qwen3.py": (  # 2 s
        "test_an_fp8_build_loads_and_stays_close",
    ),
    "tests/models/test_smollm2_vs_hf.py": (  # 2 s
        "test_beam_search_matches_hf",
    ),
    "tests/server/test_agent_prefix_cache.py": (  # 2 s
        "test_a_changing_header_line_does_not_force_a_re_prefill",
    ),
    "tests/server/test_connections.py": (  # 7 s
        "test_connections_over_the_cap_are_refused_and_the_reserve_serves_health",
        "test_headers_never_finished_are_closed_after_the_timeout",
    ),
    "tests/server/test_kserve.py": (  # 1 s
        "test_tensorrt_llm_http_equals_completions",
    ),
    "tests/server/test_openai_api.py": (  # 10 s
        "test_created_is_each_responses_own",
        "test_bench_serve_client",
        "test_chat_equals_offline",
        "test_histograms_count_finished_requests",
        "test_disconnects_count_as_aborted",
    ),
    "tests/server/test_request_bounds.py": (  # 2 s
        "test_a_slow_template_runs_off_the_loop",
    ),
    "tests/spec_decode/test_eagle3.py": (  # 2 s
        "test_eagle3_trained_head_accepts_drafts_and_stays_exact",
    ),
    "tests/spec_decode/test_spec_decode.py": (  # 2 s
        "test_seeded_sampling_with_drafts_does_not_depend_on_the_batch",
    ),
    "tests/test_llm.py": (  # 7 s
        "test_penalties_change_output",
        "test_async_scheduling_defaults_off_on_the_cpu_and_can_be_forced",
        "test_dropped_llm_frees_its_engine",
        "test_engine_raises_the_gc_gen0_threshold",
    ),
}

# "path::name" (a class's tests: "path::Class::name"), as pytest's node ids without parameters.
SLOW_TESTS = frozenset(
    f"{path}::{name}"
    for table in (_BY_FILE, _FAST_RUN_TRIM)
    for path, names in table.items()
    for name in names
)
