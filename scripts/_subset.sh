# Sourced by scripts/test_floor.sh and scripts/test_newest.sh: the tests they run by default,
# chosen among the serial-twin and round-trip tests so that every module of eqpar/ is run by
# at least one of them, within CI's time.
# Each test (or test file) and the modules of eqpar/ it runs: every module is in some line.
SUBSET=(
    tests/test_spmd.py  # spmd, _specs, layout, _paths, mesh
    tests/test_planning.py::test_a_plan_on_a_mesh_larger_than_the_machine  # planning, _program_figures
    tests/test_layout.py  # layout, _declare, _matching (LayoutMap)
    "tests/test_axis_types.py::test_shard_map_takes_arguments_typed_otherwise_and_equals_one_device"  # _axis_types
    tests/test_axis_types.py::test_quick_start_runs_as_printed_on_explicit_and_mixed_meshes  # _axis_types, nn/_own_region
    "tests/test_pipeline.py::test_matches_serial_twin[gpipe-4-4]"  # pipeline, nn/pipeline, _vma
    "tests/test_pipeline.py::test_matches_serial_twin[circular-4-4]"  # pipeline, nn/pipeline
    "tests/test_pipeline.py::test_matches_serial_twin[1f1b-4-4]"  # pipeline, nn/pipeline
    "tests/test_pipeline.py::test_data_by_pipe_mesh[1f1b]"  # pipeline: the one gradient rule
    "tests/test_pipeline_residuals.py::test_every_training_schedule_adds_each_layers_gradient_into_the_sum[zb-h1-none-8]"  # pipeline/_layered
    "tests/test_layered_backward.py::test_a_constant_built_in_the_layer_trains_like_the_serial_model[1f1b]"  # _layered: the jaxpr walk
    "tests/test_pipeline_by_plan.py::test_llama_with_raw_arrays_and_a_static_layer_index_pipelined_by_plan[1]"  # plan Pipeline, nn/pipelined
    tests/test_pipeline_schedule.py::test_one_f_one_b_bubble_order_and_memory  # schedule
    "tests/test_execute_schedule.py::test_execute_schedule_matches_serial_twin[zb-h1 S=4]"  # _program, schedule
    tests/test_checkpoint.py::test_round_trip_keeps_values_types_and_static_leaves  # checkpoint, _checksums
    tests/test_checkpoint.py::test_restore_onto_another_mesh_is_bitwise_equal  # checkpoint
    tests/test_checkpoint.py::test_damaged_checkpoint_errors_and_falls_back  # checkpoint
    tests/test_tensor_parallel.py::test_forward_and_gradients_match_linear  # nn/tensor_parallel
    tests/test_blocks.py::test_block_matches_serial_twin  # nn/blocks
    "tests/test_plan.py::test_sgd_step_with_dropout_equals_serial[dp2xtp4]"  # plan, nn/parallel_layers
    tests/test_distribution.py::test_three_optax_steps_match_single_device  # distributions
    tests/test_collectives.py::test_gather_gradients_equal_all_gather  # collectives
    tests/test_context_parallel.py::test_attention_matches_serial  # context
    tests/test_precision.py::test_data_parallel_equals_serial_under_bfloat16  # precision
    tests/test_placement.py::test_full_round_trip_gives_the_rows_back  # placement
    tests/test_ragged.py::test_pack_splits_sharded_over_a_mesh_matches_the_serial_split  # ragged
    tests/test_inspect.py  # inspect, benchmarks/_hlo
    tests/test_hlo_axes.py  # benchmarks/_hlo
    tests/test_package.py  # __init__, _typing (the public names import)
    "tests/test_experts.py::test_expert_parallel_step_equals_serial[data2-expert4-skewed]"  # nn/experts, plan ExpertParallel
)
