"""The slow tier: the tests that `python -m pytest -q` leaves out (`-m slow` runs them).

Each expensive family keeps one representative in the default tier, named in its
comment; the rest of the family is here. An entry is a test's node id, or a prefix of it
that ends at a file, a test or a parametrization. Seconds are each test's time in a full
run (`pytest --durations=0`) on the 2-core CPU box, 2026-11-27, with other jobs beside it:
what a test costs, not a benchmark. tests/conftest.py refuses an entry that names no test.
"""
from __future__ import annotations

SLOW = {
    # --- whole runs of `python -m muajax.train` (subprocesses). Default tier: the short GRPO
    # run that must raise reward (tests/train/test_train.py::test_short_grpo_run_raises_reward_...)
    # and one kill -9 resume (the SFT one, [sft-config1-6]).
    "tests/train/test_train.py::test_kill9_then_resume_equals_an_uninterrupted_run[grpo-config0-4]": 67,
    "tests/train/test_determinism.py": 107,
    "tests/train/test_grpo.py::test_ppo_epochs_make_several_updates_per_step": 85,
    "tests/train/test_grpo.py::test_recomputed_old_logprobs_in_the_grpo_stage": 71,
    "tests/train/test_grpo_off_policy.py::test_the_grpo_stage_logs_the_off_policy_correction": 26,
    # the cap's whole-step tests (default tier: test_no_recompute_no_off_policy_metrics)
    "tests/rl/test_off_policy_step.py::test_the_cap_weights_every_token_of_the_first_update": 17,
    # --- single tests over ~8 s whose families keep others in the default tier (seconds at load ~2,
    # tests/rl/test_sft.py, tests/test_eval_cli.py, tests/serving/, tests/agent/test_conversation.py)
    "tests/rl/test_sft.py::test_sft_step_is_the_masked_token_mean_nll": 11,
    "tests/test_eval_cli.py::test_a_cut_off_rollout_scores_0_whatever_the_database_says": 10,
    "tests/serving/test_scheduler.py::test_a_failing_step_fails_only_the_request_that_fails_it": 27,
    "tests/agent/test_conversation.py::test_the_rollout_loop_prefills_a_conversation_again_when_its_tools_change": 8,
    "tests/train/test_grpo.py::test_a_run_whose_steps_keep_going_non_finite_stops_after_saving": 42,
    "tests/train/test_grpo.py::test_one_mini_batch_of_the_whole_batch_is_the_paper_s_update": 30,
    "tests/train/test_resume.py::test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one": 57,
    "tests/train/test_failed_rollouts.py::test_a_user_endpoint_down_for_the_whole_run_stops_training": 37,
    "tests/train/test_failed_rollouts.py::test_a_grpo_step_trains_on_the_rollouts_that_did_not_fail": 37,
    "tests/train/test_paced_user.py::test_a_grpo_run_against_a_throttling_stalling_endpoint_completes_with_its_failures_masked": 40,
    "tests/train/test_mcp_grpo.py": 52,
    "tests/train/test_secrets_in_a_run.py::test_the_api_key_reaches_no_file_of_the_run_and_no_output": 47,
    "tests/train/test_step_metrics.py::test_an_sft_and_grpo_run_logs_throughput_and_writes_its_traces": 42,
    "tests/train/test_compilation.py": 24,
    "tests/train/test_pretraining.py::test_domain_warmup_learns_its_windows_is_seeded_and_needs_the_builtin_domain": 24,
    "tests/train/test_pretraining.py::test_copy_warmup_teaches_copying_and_is_seeded": 10,
    "tests/test_ablation.py::test_one_seed_end_to_end": 61,
    "tests/test_pretrain.py::test_pretrain_continues_from_a_base_with_the_system_prompt": 33,
    "tests/test_pretrain.py::test_pretrain_writes_an_hf_base_with_its_vocabulary_and_record": 13,
    # --- multi-host: two jax processes. Default tier: test_distributed_helpers_across_two_processes.
    "tests/train/test_multihost.py::test_two_processes_train_exactly_like_one_process_with_the_same_global_batch[0]": 75,
    "tests/train/test_multihost.py::test_two_processes_train_exactly_like_one_process_with_the_same_global_batch[1]": 66,
    "tests/train/test_multihost_eval.py::test_two_processes_evaluate_a_share_each_and_report_what_one_process_reports": 123,
    # the fingerprint and export of params split across two processes (default tier: the same on 8 devices
    # of one process, tests/models/test_host_blocks.py::test_sharded_on_8_devices_equals_one_device)
    "tests/models/test_host_blocks.py::test_split_across_two_processes_equals_one_device": 52,
    # the whole reduced device check (all checks and figures, a subprocess; default tier: its logit and
    # attention checks and a wrong model failing them, tests/bench/test_device_bench.py)
    "tests/bench/test_device_bench.py::test_the_reduced_device_check_passes_on_cpu": 61,
    # --- SIGTERM in the middle of a GRPO step's rollout (muajax.runtime.stopping): whole runs
    # stopped, then resumed. Default tier: tests/runtime/test_stopping.py (signal -> stop ->
    # the last finished step saved -> exit 75) and tests/agent/test_rollout_stop.py.
    "tests/train/test_stop_resume.py::test_sigterm_mid_rollout_stops_saves_and_resumes_to_the_same_params": 351,
    "tests/train/test_stop_resume.py::test_two_processes_stop_together_when_one_is_signalled_and_resume_to_the_same_params": 177,
    "tests/train/test_stop_resume.py::test_an_asynchronous_run_stops_mid_rollout_and_resumes": 183,
    # --- asynchronous GRPO's whole runs. Default tier: the handoff and rollout thread's unit
    # tests (tests/train/test_async_grpo.py, tests/runtime/test_rollout_engine.py).
    "tests/train/test_async_grpo.py::test_no_row_is_trained_above_the_bound[2-True]": 14,
    "tests/train/test_async_grpo.py::test_a_step_whose_rollouts_failed_stops_the_asynchronous_run_cleanly": 8,
    "tests/train/test_async_grpo.py::test_max_staleness_zero_is_the_synchronous_loop": 39,
    "tests/train/test_async_grpo.py::test_kill9_during_an_asynchronous_run_resumes_and_finishes": 44,
    "tests/train/test_async_grpo.py::test_no_row_is_trained_above_the_bound[1-False]": 30,
    "tests/train/test_async_grpo.py::test_partial_rollouts_switch_weights_inside_a_conversation": 18,
    "tests/train/test_async_grpo.py::test_asynchronous_runs_repeat_whatever_the_users_timing": 30,
    # --- end to end on τ2 (synthetic data, SFT, GRPO, evaluation) and τ2's own protocol.
    # Default tier: τ2's unit tests (its tools, splits and scoring); the end-to-end
    # representative is the short GRPO run above.
    "tests/test_smoke_tau2.py": 80,
    "tests/domains/tau1/test_tau1_training.py": 35,  # τ1 tasks: two GRPO steps, evaluated on τ2 (issue 34)
    "tests/serving/test_tau2_protocol.py::test_an_agent_whose_replies_tau2_refuses_scores_zero_and_a_dead_user_stops": 55,
    "tests/serving/test_tau2_protocol.py::test_tau2_protocol_on_airline_tasks_with_an_http_user": 37,
    "tests/serving/test_serve.py::test_tau2_cli_completes_a_run_against_the_server": 23,
    "tests/test_eval_cli.py::test_muajax_protocol_reports_each_tau2_domain_and_the_twin_free_score": 26,
    "tests/domains/tau2/test_tau2.py::test_gold_replay_scores_one[airline]": 20,
    "tests/domains/tau2/test_tau2.py::test_gold_replay_scores_one[retail]": 17,
    # --- the planner on the TPU compiler. Default tier: tests/planning/test_planner.py (one set
    # of TPU compiles, shared by its tests) and the plan command's cheap checks.
    "tests/planning/test_sweep.py::test_a_stopped_sweep_resumes_where_it_was": 104,
    "tests/planning/test_plans_what_runs.py": 23,
    "tests/planning/test_sweep.py::test_other_remats_are_tried_on_the_fastest_meshes_only": 83,
    "tests/planning/test_sweep.py::test_sweep_ranks_prunes_and_writes": 52,
    "tests/planning/test_sweep.py::test_with_a_rollout_profile_meshes_rank_by_the_whole_step": 29,
    "tests/test_plan.py::test_plan_a_run_config_as_the_trainer_runs_it": 20,
    "tests/test_plan.py::test_the_configs_engine_pool_is_planned": 19,
    "tests/test_plan.py::test_too_big_exits_1": 18,
    "tests/test_plan.py::test_plan_on_a_v5p_slice": 13,
    "tests/test_plan.py::test_a_config_too_big_for_its_chip_exits_1": 12,
    "tests/test_plan.py::test_fake_cpu_mesh_reexecs_and_judges_against_a_chip": 9,
    "tests/test_plan.py::test_flag_defaults_take_the_least_memory_a_step_can": 7,
    "tests/planning/test_moe_plan.py::test_a_tiny_mixture_of_experts_plans_on_an_expert_parallel_mesh": 55,
    "tests/engine/test_programs.py::test_pallas_programs_compile_for_a_tpu_topology": 10,
    "tests/rl/test_step_memory.py": 43,
    # --- the engine's fixed rows, sharded pool and Pallas kernel. Default tier: fixed rows'
    # warm-up [2] and release, one collective check [2,2,2], the kernel against pure JAX [mixed].
    "tests/engine/test_fixed_rows.py::test_with_fixed_rows_a_conversation_is_bitwise_the_same_whatever_shares_its_calls": 34,
    # packed extends with token tiles. Default tier: [7-reference] and the attention agreement.
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others[1-reference]": 12,
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others[1-paged]": 10,
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others[7-paged]": 15,
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others[63-reference]": 30,
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others[63-paged]": 25,
    "tests/engine/test_packed_extends.py::test_without_token_tiles_the_bits_follow_the_call": 21,
    "tests/engine/test_fixed_rows.py::test_bucketed_calls_round_differently_with_other_rows": 19,
    "tests/engine/test_fixed_rows.py::test_warmup_compiles_every_program_conversations_then_use[None]": 10,
    "tests/engine/test_programs.py::test_sharded_pool_generates_what_one_device_does": 25,
    "tests/engine/test_programs.py::test_no_collective_grows_with_the_cache[8,1,1]": 6,
    "tests/engine/test_programs.py::test_no_collective_grows_with_the_cache[1,8,1]": 6,
    "tests/engine/test_programs.py::test_no_collective_grows_with_the_cache[1,2,4]": 5,
    "tests/engine/test_paged_attention.py::test_engine_on_the_pallas_kernel_equals_the_pure_jax_engine": 30,
    "tests/engine/test_paged_attention.py::test_pure_jax_paged_attention_equals_the_pallas_kernel[decode]": 6,
    "tests/engine/test_paged_attention.py::test_pure_jax_paged_attention_equals_the_pallas_kernel[prefill]": 5,
    "tests/engine/test_paged_attention.py::test_pure_jax_paged_attention_equals_the_pallas_kernel[padded rows]": 3,
    "tests/engine/test_dense_decode.py::test_the_tail_and_in_place_writes_agree[0.0-True]": 5,
    "tests/engine/test_dense_decode.py::test_the_tail_and_in_place_writes_agree[1.0-False]": 4,
    # --- attention implementations against the einsum reference, over five shapes each.
    # Default tier: [causal_gqa2_h64] and [packed_gqa4_h64], chunked and splash (interpret mode).
    "tests/models/test_attention.py::test_implementation_equals_the_einsum_reference[causal_gqa1_h128-chunked]": 2,
    "tests/models/test_attention.py::test_implementation_equals_the_einsum_reference[causal_gqa1_h128-splash]": 2,
    "tests/models/test_attention.py::test_implementation_equals_the_einsum_reference[packed_gqa2_h128-chunked]": 2,
    "tests/models/test_attention.py::test_implementation_equals_the_einsum_reference[packed_gqa2_h128-splash]": 2,
    "tests/models/test_attention.py::test_implementation_equals_the_einsum_reference[right_padding_gqa4_h64-chunked]": 2,
    "tests/models/test_attention.py::test_implementation_equals_the_einsum_reference[right_padding_gqa4_h64-splash]": 3,
    "tests/models/test_attention.py::test_chunked_memory_grows_linearly_and_the_reference_quadratically": 13,
    "tests/models/test_attention.py::test_splash_under_shard_map_equals_the_reference_on_a_cpu_mesh": 9,
    # --- the model's other forward forms. Default tier: the chunked implementation's logits and
    # gradients, packed rows' logits, the in-place cache against per-layer slices.
    "tests/models/test_qwen3.py::test_shared_prefix_forward_with_chunked_attention_equals_the_full_forward": 8,
    "tests/models/test_qwen3.py::test_packed_rows_give_the_rl_head_the_unpacked_logprobs": 5,
    "tests/models/test_qwen3.py::test_attention_implementations_give_the_reference_logits_and_gradients[splash]": 5,
    "tests/models/test_qwen3.py::test_unrolled_per_layer_cache_equals_stacked[headdim_unlike]": 5,
    # --- the engine's long scenarios. Default tier: its equality with a full forward and with
    # transformers' generate, pages coming back, a waiting conversation starting.
    "tests/engine/test_engine.py::test_sampling_reproducible_whatever_other_slots_do": 9,
    "tests/engine/test_paged_engine.py::test_small_pool_preempts_and_completes_every_conversation_like_a_big_pool": 12,
    # --- a rollout whose scripted users answer after a delay, on an 8-slot engine of its own.
    # Default tier: tests/domains/test_latency.py's concurrent sessions.
    "tests/agent/test_rollout_user_latency.py::test_the_conversations_wait_on_their_users_together": 25,
    # --- commands over whole domains. Default tier: synth with the expert and on MCP, BFCL's scoring.
    "tests/test_synth_cli.py::test_failed_conversations_are_never_kept": 9,
    "tests/domains/bfcl/test_bfcl.py::test_eval_cli_on_bfcl": 7,
    # ACEBench: two saved policies against a fake user (default tier: its gold replay through the CLI)
    "tests/domains/acebench/test_acebench_eval.py::test_a_saved_policy_against_a_fake_user_endpoint": 40,
    "tests/test_pretrain.py::test_a_run_loads_the_base_and_refuses_what_does_not_fit": 11,
    # --- the model on 8 devices over the sequence axis. Default tier: the 8-device step
    # scenarios of tests/rl/test_step.py (sharded equals one device).
    "tests/models/test_context_parallel.py": 39,
    # --- the model's cache forms, each over five shapes. Default tier: [headdim_unlike].
    "tests/models/test_qwen3.py::test_cached_extend_and_decode_equal_full_forward[tied]": 7,
    "tests/models/test_qwen3.py::test_cached_extend_and_decode_equal_full_forward[kv_ratio1]": 7,
    "tests/models/test_qwen3.py::test_cached_extend_and_decode_equal_full_forward[kv_ratio4]": 5,
    "tests/models/test_qwen3.py::test_cached_extend_and_decode_equal_full_forward[untied_kv2]": 5,
    "tests/models/test_qwen3.py::test_unrolled_per_layer_cache_equals_stacked[tied]": 4,
    "tests/models/test_qwen3.py::test_unrolled_per_layer_cache_equals_stacked[kv_ratio1]": 4,
    "tests/models/test_qwen3.py::test_unrolled_per_layer_cache_equals_stacked[kv_ratio4]": 5,
    "tests/models/test_qwen3.py::test_unrolled_per_layer_cache_equals_stacked[untied_kv2]": 4,
    "tests/models/test_qwen3.py::test_in_place_cache_equals_per_layer_slices[tied]": 4,
    "tests/models/test_qwen3.py::test_in_place_cache_equals_per_layer_slices[kv_ratio1]": 4,
    "tests/models/test_qwen3.py::test_in_place_cache_equals_per_layer_slices[kv_ratio4]": 4,
    "tests/models/test_qwen3.py::test_in_place_cache_equals_per_layer_slices[untied_kv2]": 4,
    # --- the commands that load a checkpoint in a subprocess. Default tier: eval on the
    # built-in domain, export in full vocabulary, parity's argument and comparison checks.
    "tests/test_parity_cli.py::test_one_corrupted_muajax_weight_exits_1": 27,
    "tests/test_parity_cli.py::test_tiny_checkpoint_passes_logits_and_greedy_tokens": 22,
    "tests/test_parity_cli.py::test_splash_attention_on_long_prompts_passes": 17,
    "tests/test_export.py::test_domain_vocab_run_exports_expanded_and_matches_transformers": 15,
    # --- the server under load. Default tier: its protocol, streaming, keys and 4xx tests.
    "tests/serving/test_serve.py::test_many_concurrent_requests_are_batched_continuously": 27,
    "tests/serving/test_app.py::test_good_requests_come_out_as_alone_while_bad_ones_get_4xx": 24,
    # --- benches in their quick form. Default tier: bench forward --quick and the CLI's errors.
    "tests/bench/test_engine_benches.py::test_rollout_quick_prefills_the_shared_system_prompt_once": 15,
    "tests/bench/test_rollout_profile.py::test_rollout_quick_counts_real_and_computed_positions_in_both_modes": 47,
    "tests/bench/test_engine_benches.py::test_generate_max_len_compares_with_a_short_max_len": 8,
    "tests/bench/test_engine_benches.py::test_multiturn_quick": 8,
    # the extend floor's program run (its parity test is below; the decode floor's stays in the default tier)
    "tests/bench/test_extend_floor.py::test_the_extend_floor_program_returns_every_layers_new_keys_and_values": 3,
    "tests/bench/test_engine_benches.py::test_generate_times_the_floor_without_transformers": 15,
    "tests/bench/test_engine_benches.py::test_generate_quick": 8,
    "tests/bench/test_bench_cli.py::test_train_quick_times_muajax_beside_torch_and_another_attention": 13,
    "tests/bench/test_async_bench.py::test_quick_run_reports_both_runs_and_the_speedups": 60,
    # --- one of two forms of the same equality. Default tier: the other form.
    "tests/runtime/test_packing.py::test_packed_rows_give_the_loss_and_gradient_of_unpacked_ones[xla]": 12,
    "tests/rl/test_old_logprobs.py::test_recomputed_old_logprobs_make_the_first_ratio_exactly_one": 23,
    "tests/rl/test_old_logprobs.py::test_the_mini_batch_forward_gives_the_trainer_s_logprobs[2]": 8,
    "tests/rl/test_sequence.py::test_chunked_logits_equal_the_whole_head[padded]": 5,
    # --- packed GRPO rows equal padded ones. Default tier: token-mean with and without the
    # shared prefix ([options0-0], [options0-12]); the other aggregations and the whole step here.
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options1-0]": 10,
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options1-12]": 15,
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options2-0]": 8,
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options2-12]": 16,
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options3-0]": 10,
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options3-12]": 20,
    "tests/rl/test_grpo_packed.py::test_the_packed_step_updates_as_the_padded_one_in_microbatches": 30,
    # --- the on-policy GRPO path bitwise unchanged by the off-policy correction. Default tier:
    # the loss and its gradient (test_the_on_policy_loss_and_gradient_are_bitwise_today_s); the whole step here.
    "tests/rl/test_off_policy_unchanged.py::test_the_on_policy_update_is_bitwise_today_s": 44,
    # --- the router's load-balancing loss. Default tier: SFT's (added, reported, none for a
    # dense model), the real tokens' aux loss and the shared-prefix / packed one.
    "tests/rl/test_moe_aux.py::test_grpo_loss_adds_coef_times_the_aux_loss_and_it_moves_the_router": 24,
    # --- a mixture of experts' GRPO step on 8 devices with expert = 2, 4, 8 equals one device.
    # Default tier: expert_ffn alone on those meshes (tests/models/test_moe_dispatch.py).
    "tests/rl/test_moe_step.py": 105,
    # --- Qwen3-MoE's greedy tokens against HF generate, two more shapes (seconds at load ~9).
    # Default tier: [e4_k2_norm] and [e8_k2_plain]; every shape's logits stay there.
    "tests/models/test_moe_parity.py::test_greedy_tokens_equal_hf_generate[e12_k3_plain_tied_3layers]": 16,
    "tests/models/test_moe_parity.py::test_greedy_tokens_equal_hf_generate[e16_k4_norm]": 15,
    # --- the engine on a mixture of experts (seconds at load ~9). Default tier: greedy tokens on
    # the dense layer-scan decode, recorded experts on the dense path (its CPU recording
    # decode reads pages in place), preemption, warmup, and the packed-extend bits on paged.
    "tests/engine/test_moe_engine.py::test_greedy_tokens_equal_the_plain_forward_on_every_decode_path[fixed-rows]": 48,
    "tests/engine/test_moe_engine.py::test_greedy_tokens_equal_the_plain_forward_on_every_decode_path[token-tiles]": 42,
    "tests/engine/test_moe_engine.py::test_greedy_tokens_equal_the_plain_forward_on_every_decode_path[paged]": 37,
    "tests/engine/test_moe_engine.py::test_greedy_tokens_equal_the_plain_forward_on_every_decode_path[dense-per-layer]": 36,
    "tests/engine/test_moe_engine.py::test_recorded_experts_are_the_plain_forwards_for_every_cached_token[paged]": 42,
    "tests/engine/test_moe_engine.py::test_recorded_experts_are_the_plain_forwards_for_every_cached_token[token-tiles]": 29,
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_mixture_of_experts_conversation_is_bitwise_the_same_beside_63_others[reference]": 24,
    "tests/engine/test_moe_engine.py::test_a_mixture_of_experts_programs_compile_on_the_pallas_path_for_a_tpu_topology": 26,
    "tests/engine/test_moe_engine.py::test_warmup_compiles_every_program_a_mixture_of_experts_then_uses[plain]": 71,
    # --- routing replay (seconds at load ~9). Default tier: the trainer's logprobs equal the
    # engine's with replay and differ without, padded and packed rows; the config key.
    "tests/rl/test_routing_replay.py::test_the_first_pass_ratio_deviation_with_and_without_replay": 108,
    "tests/rl/test_routing_replay.py::test_with_replay_the_trainer_s_logprobs_are_the_engine_s[shared-prefix-padded]": 25,
    "tests/rl/test_routing_replay.py::test_with_replay_the_trainer_s_logprobs_are_the_engine_s[shared-prefix-packed]": 24,
    # the rollout loop's trajectories carry the engine's experts (a tiny MoE with the real vocabulary)
    "tests/agent/test_rollout_experts.py": 55,
    # --- moved out of the default tier to keep it under 10 minutes once the mixture-of-experts
    # tests came in (seconds from a fresh clone's full default run, nothing else running, where
    # the default tier took 11 min 53 s). Each family keeps others in the default tier: the MoE
    # engine its recording test, routing its layer-scan paths, the aux loss its real-token test,
    # parity its first greedy shape, the step and SFT their other losses, resume its other refusals.
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_mixture_of_experts_conversation_is_bitwise_the_same_beside_63_others[paged]": 13,
    "tests/engine/test_moe_engine.py::test_warmup_compiles_every_program_a_mixture_of_experts_then_uses[recording]": 8,
    "tests/engine/test_moe_engine.py::test_greedy_tokens_equal_the_plain_forward_on_every_decode_path[dense-layer-scan]": 10,
    "tests/engine/test_moe_engine.py::test_a_preempted_conversation_records_its_recomputed_experts": 5,
    "tests/bench/test_bench_cli.py::test_forward_moe_quick_compares_the_mixture_of_experts_with_transformers": 7,
    "tests/rl/test_moe_aux.py::test_a_shared_prefix_and_packed_rows_count_the_same_tokens": 6,
    "tests/rl/test_moe_aux.py::test_sft_reports_the_aux_loss_and_a_dense_model_has_none": 5,
    "tests/models/test_moe_routing.py::test_the_shared_prefix_forward_routes_and_replays_like_forward": 6,
    "tests/models/test_moe_routing.py::test_each_path_chooses_and_obeys_experts_as_the_layer_scan_does[in_place]": 5,
    "tests/models/test_moe_routing.py::test_each_path_chooses_and_obeys_experts_as_the_layer_scan_does[extends]": 5,
    "tests/models/test_moe_parity.py::test_greedy_tokens_equal_hf_generate[e8_k2_plain]": 3,
    "tests/rl/test_step.py::test_loss_matches_the_documented_alignment": 22,
    "tests/models/test_host_blocks.py::test_sharded_on_8_devices_equals_one_device": 8,
    "tests/train/test_resume.py::test_a_restore_that_fails_with_an_io_error_stops_the_run_and_moves_nothing": 7,
    "tests/train/test_resume.py::test_a_changed_config_names_the_keys_that_change_the_math": 6,
    "tests/rl/test_sft.py::test_sft_tail_of_non_assistant_tokens_does_not_change_the_loss": 7,
    "tests/runtime/test_packing.py::test_packed_rows_give_the_loss_and_gradient_of_unpacked_ones[chunked]": 6,
    "tests/planning/test_plan_flops.py::test_steps_count_their_kernels_and_match_the_analytic_count": 7,
    "tests/engine/test_paged_engine.py::test_shared_prefix_gives_the_same_tokens_and_logprobs": 7,
    # (a second fresh-clone run after the moves above still took 10 min 22 s: ten more)
    "tests/domains/test_openai_user_pacing.py::test_requests_per_minute_hold_at_the_endpoint_through_429s_and_stalls": 8,
    "tests/models/test_attention.py::test_splash_compiles_for_tpu_with_the_pallas_kernel": 7,
    "tests/engine/test_packed_extends.py::test_with_token_tiles_a_conversation_is_bitwise_the_same_beside_1_7_and_63_others[7-reference]": 7,
    "tests/engine/test_engine.py::test_multiturn_cache_equals_one_full_forward_and_reuse_is_clean": 6,
    "tests/test_readme.py::test_help_exits_0[muajax.ablation]": 6,
    "tests/bench/test_device_bench.py::test_the_quick_checks_pass_and_a_wrong_model_fails_them": 5,
    "tests/engine/test_programs.py::test_no_collective_grows_with_the_cache[2,2,2]": 5,
    # (2026-11-28: two fresh-clone default runs took 10 min 17 s and 9 min 42 s, nothing else
    # running: these, about 65 s of it. Each family keeps others in the default tier: the step
    # its NaN, KL and mesh tests, dispatch its all-to-all and plain paths, SFT its losses, the
    # engine its equality tests, routing its layer-scan and token-tile paths.)
    "tests/rl/test_step.py::test_microbatches_give_the_full_batch_update": 24,
    "tests/models/test_moe_dispatch.py::test_expert_parallel_ffn_equals_one_device": 9,
    "tests/engine/test_packed_extends.py::test_a_conversation_alone_in_a_one_tile_call_rounds_as_beside_others": 7,
    "tests/rl/test_sft.py::test_sft_sharded_microbatched_step_matches_one_device": 7,
    "tests/engine/test_engine.py::test_stacked_decode_equals_per_layer_views": 6,
    "tests/models/test_moe_routing.py::test_each_path_chooses_and_obeys_experts_as_the_layer_scan_does[sliced_cache]": 8,
    # (a fresh-clone default run after those still took 9 min 50 s: these, about 45 s, from
    # families that keep others in the default tier)
    "tests/agent/test_rollout_fuzz.py::test_broken_users_end_only_their_own_episodes_inside_the_real_loop": 7,
    "tests/engine/test_engine.py::test_sampled_logprobs_equal_full_forward": 5,
    "tests/bench/test_extend_floor.py::test_the_extend_floor_gives_transformers_logits_and_cache_for_a_turn": 5,
    "tests/domains/mcp/test_mcp.py::test_bad_calls_and_timeouts_are_error_observations": 4,
    "tests/planning/test_planner.py::test_a_pool_kept_through_the_update_is_counted_there": 4,
    "tests/models/test_qwen3.py::test_remat_does_not_change_gradients": 4,
    "tests/models/test_qwen3.py::test_dots_remat_keeps_the_chunked_attention_output_instead_of_rerunning_it": 3,
    "tests/models/test_qwen3.py::test_logits_fp32_runs_the_head_in_float32": 4,
    "tests/models/test_moe_hf.py::test_loaded_onto_8_devices_by_the_logical_axes": 4,
    "tests/models/test_moe.py::test_the_moe_model_initialises_and_runs_with_its_routing_out": 4,
    "tests/rl/test_grpo_packed.py::test_packed_rows_give_the_padded_loss_and_gradient[options0-12]": 5,
    "tests/rl/test_sequence.py::test_chunked_logits_equal_the_whole_head[divides]": 5,
    "tests/rl/test_old_logprobs.py::test_the_mini_batch_forward_gives_the_trainer_s_logprobs[1]": 5,
    # (2026-11-28, later: a fresh-clone default run took 10 min 31 s, two others 9 min 35 s and
    # 9 min 14 s, nothing else running: these, about 32 s. SFT keeps its loss tests, the eval
    # CLI and bench CLI their other runs, the aux loss its real-token test, routing its hook
    # and token-tile paths.)
    "tests/rl/test_sft.py::test_sft_steps_learn_the_assistant_tokens": 8,
    "tests/test_eval_cli.py::test_eval_cli_on_the_builtin_domain": 6,
    "tests/bench/test_bench_cli.py::test_forward_quick_prints_both_figures_and_a_json_last_line": 6,
    "tests/rl/test_moe_aux.py::test_the_aux_loss_is_that_of_the_real_tokens_and_leaves_the_logprobs_alone": 6,
    "tests/models/test_moe_routing.py::test_each_path_chooses_and_obeys_experts_as_the_layer_scan_does[per_layer]": 6,
}
