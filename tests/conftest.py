"""Shared fixtures: uninterrupted reference runs, made once per test session; and the fast tier.

The fast tier (`bash scripts/test.sh --fast`, or `pytest -m fast`) is every test of the modules in
FAST_MODULES (pure decisions, the wire, in-process schedulers and short multi-process checks) and the tests
named in FAST_TESTS: at least one from each package, and real multi-process recoveries (kill -9 with a hot
spare, a scheduler kill and restart, SIGSTOP through the heartbeat relay, a rank killed inside a
collective). It runs in a few minutes; `bash scripts/test.sh` runs everything, as CI does."""

from __future__ import annotations

import pytest
from harness import baselines

FAST_MODULES = {
    "test_checkpoint_codec", "test_checkpoint_format", "test_checkpoint_jobsave", "test_checkpoint_manifest",
    "test_ckpt_cli", "test_config", "test_data", "test_events", "test_gradsync", "test_group_names",
    "test_layering", "test_membership", "test_protocol", "test_restart_budget", "test_restore_plan",
    "test_sched_child", "test_scheduler_conn", "test_scheduler_scale", "test_scheduler_wire", "test_shard_plan",
    "test_slurm_env", "test_strategies", "test_stuck_collectives", "test_user_state",
}
FAST_TESTS = (  # module::test name (a prefix: every parametrisation)
    "test_transformers::test_measured_values_are_kept_apart_and_put_back",
    "test_recovery::test_one_worker_killed_twice_loses_no_step",
    "test_recovery::test_scheduler_killed_and_restarted_no_rollback",
    "test_heartbeat_relay::test_a_stopped_worker_is_fenced_through_the_relay",
    "test_heartbeat_relay::test_the_relay_serves_only_its_own_workers",
    "test_auth::test_a_stranger_without_the_secret_gets_no_answer",
    "test_auth::test_wrong_or_missing_secret_is_refused",
    "test_auth::test_a_worker_holds_a_secret_of_its_own",
    "test_auth::test_values_that_would_break_the_scheduler",
    "test_scheduler_bounds::test_the_fuzzers_extremes_are_refused",
    "test_scheduler_bounds::test_the_edge_of_every_range_is_accepted",
    "test_launcher::test_bad_input_exits_2",
    "test_launcher::test_port_in_use_is_a_clear_error",
    "test_launcher::test_every_line_is_prefixed_and_env_is_set",
    "test_launcher::test_sigterm_is_forwarded_workers_first",
    "test_launcher::test_scheduler_crash_is_restarted_in_place",
    "test_observe::test_metrics_follow_prometheus_conventions",
    "test_observe::test_a_recovery_splits_into_phases_that_add_up",
    "test_elastic::test_every_index_once_across_world_changes",
    "test_elastic::test_phase_padding_and_drop_last",
    "test_spares::test_pool_",
    "test_spares::test_hot_spares_flag_and_env",
    "test_zygote::test_a_",
    "test_zygote::test_an_order_must_bring_its_descriptors",
)


# The longest files (wall time per file in a full run here, longest first) start first: pytest-xdist hands
# out files in collection order, so the last ones to start, which the run waits for alone, are short.
LONGEST_FIRST = (  # measured 2026-11-29 (the sum of each file's test durations over the 80 slowest tests, -n 3)
    "test_lightning", "test_ported_trainers", "test_transformers", "test_accelerate", "test_pipeline", "test_verify",
    "test_exactsum", "test_sharded_engine", "test_recovery", "test_desync", "test_multihost", "test_zygote",
    "test_virtual_shards", "test_frameworks", "test_elastic", "test_graceful", "test_cluster_errors", "test_observe",
    "test_seed_flow", "test_compiled", "test_loader_workers", "test_gradsync", "test_launch_compat",
    "test_transformer_tp", "test_real_trainer", "test_lightning_ranks", "test_reshard", "test_stuck_collectives",
    "test_foreign_trainer", "test_deterministic_errors", "test_nanogpt", "test_checkpoint_job", "test_ddp_tutorial",
    "test_spares", "test_examples", "test_audit", "test_commit_protocol", "test_recover_strategy", "test_launcher",
    "test_sharded_recovery",
)


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in FAST_MODULES or f"{module}::{item.name}".startswith(FAST_TESTS):
            item.add_marker(pytest.mark.fast)
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable


@pytest.fixture(scope="session")
def baseline_runs(tmp_path_factory):
    """`get(workers, level="low", epochs=2)`: the final states of an uninterrupted tests/jobs/dp_job.py run."""
    return baselines(tmp_path_factory)
