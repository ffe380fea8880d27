"""The scheduler's pure membership decisions: no sockets, no clock (every call is given `now`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.control import formation as fm
from trainguard.control import membership as m
from trainguard.control.protocol import ErrorCode, FailureKind

FLAP, QUARANTINE = 3, 30.0


def register(c: m.Cluster, node_id: str, now: float = 0.0, *, recovery: bool = True, host: str = "h",
             pid: int = 100, worker_num: int | None = None) -> tuple[m.RegisterDecision, m.Node | None]:
    d = m.decide_register(c, node_id, worker_num or c.worker_num, now, recovery=recovery, flap_limit=FLAP,
                          quarantine_s=QUARANTINE)
    if d.action is m.Action.REJECT:
        return d, None
    return d, m.apply_register(c, d, host, pid, now, flap_limit=FLAP, quarantine_s=QUARANTINE)


def fail(c: m.Cluster, node_id: str, *, incarnation: int | None = None, kind=FailureKind.EXITED,
         recovery: bool = True) -> m.FailureDecision:
    inc = c.nodes[node_id].incarnation if incarnation is None and node_id in c.nodes else incarnation
    d = m.decide_failure(c, node_id, inc, kind, "boom", recovery=recovery)
    m.apply_failure(c, node_id, d)
    return d


def formed(ids: list[str], *, recovery: bool = True) -> m.Cluster:
    """A cluster of len(ids) workers that registered in this order and formed generation 1."""
    c = m.Cluster(worker_num=len(ids))
    for i in ids:
        d, _ = register(c, i, recovery=recovery)
        assert d.action is m.Action.ADMIT, d.reason
        c.joined.add(i)
    assert fm.try_form(c)
    return c


def ranks(c: m.Cluster) -> dict[str, int]:
    return {n.node_id: n.rank for n in c.nodes.values()}


# --- registration ------------------------------------------------------------------------


def test_new_node_is_admitted_alive_without_a_rank_until_formation():
    c = m.Cluster(worker_num=2)
    d, node = register(c, "w0", now=5.0, host="hostA", pid=42)
    assert d.action is m.Action.ADMIT and d.code is None
    assert (node.state, node.incarnation, node.rank, node.host, node.pid, node.last_seen) == (
        m.NodeState.ALIVE, 1, -1, "hostA", 42, 5.0)
    assert c.nodes == {"w0": node} and c.generation == 1 and not c.formed


def test_duplicate_live_node_id_is_rejected_with_a_reason():
    c = m.Cluster(worker_num=2)
    register(c, "w0", pid=42, host="hostA")
    d, node = register(c, "w0", pid=43)
    assert node is None and d.action is m.Action.REJECT
    assert d.code is ErrorCode.DUPLICATE and d.retry
    assert "'w0'" in d.reason and "already registered and alive" in d.reason
    assert "pid 42" in d.reason and "hostA" in d.reason
    assert c.nodes["w0"].pid == 42  # the live one is untouched


def test_worker_beyond_worker_num_is_rejected_as_full():
    c = formed(["a", "b"])
    d, node = register(c, "c")
    assert node is None and d.action is m.Action.REJECT and d.code is ErrorCode.FULL and not d.retry
    assert "cluster full" in d.reason and "a, b" in d.reason and "TG_WORKER_NUM" in d.reason
    assert set(c.nodes) == {"a", "b"}


def test_full_before_formation_too():
    c = m.Cluster(worker_num=1)
    register(c, "a")
    assert register(c, "b")[0].code is ErrorCode.FULL


def test_worker_count_mismatch_is_rejected_naming_both_counts():
    c = m.Cluster(worker_num=2)
    d, _ = register(c, "a", worker_num=3)
    assert d.code is ErrorCode.MISMATCH and "TG_WORKER_NUM=3" in d.reason and "2" in d.reason
    assert c.nodes == {}


def test_no_registration_once_the_job_is_over():
    c = formed(["a"])
    m.apply_finish(c, "a")
    assert c.job is m.JobState.DONE
    d, _ = register(c, "b")
    assert d.code is ErrorCode.JOB_OVER and "done" in d.reason


def test_finished_node_cannot_register_again():
    c = formed(["a", "b"])
    m.apply_finish(c, "a")
    assert c.job is m.JobState.RUNNING
    d, _ = register(c, "a")
    assert d.code is ErrorCode.JOB_OVER and "finished" in d.reason


def test_node_not_yet_reattached_after_scheduler_restart_is_a_retryable_duplicate():
    c = formed(["a", "b"])
    c.nodes["a"].state = m.NodeState.UNKNOWN
    d, _ = register(c, "a")
    assert d.code is ErrorCode.DUPLICATE and d.retry and "reattached" in d.reason


# --- ranks ------------------------------------------------------------------------------------


def test_rank_rule_integers_keep_their_number_others_fill_in_natural_order():
    c = formed(["b10", "3", "zeta", "1", "b9", "7"])  # N = 6: "7" is not below N
    assert ranks(c) == {"1": 1, "3": 3, "7": 0, "b9": 2, "b10": 4, "zeta": 5}


def test_ranks_are_fixed_at_formation_and_stable_across_re_registration():
    c = formed(["1", "0", "x"])
    before = ranks(c)
    assert before == {"0": 0, "1": 1, "x": 2}
    for node_id in ("x", "0"):
        fail(c, node_id)
        d, node = register(c, node_id, now=1.0)
        assert d.action is m.Action.READMIT and d.rank == before[node_id] and node.rank == before[node_id]
    c.joined.update(c.nodes)
    assert fm.try_form(c)
    assert ranks(c) == before


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_registration_order_gives_a_permutation_and_integer_ids_keep_their_rank(data):
    n = data.draw(st.integers(1, 8), label="N")
    numbers = st.integers(0, 2 * n).map(str)
    names = st.from_regex(r"[a-z][a-z0-9_.\-]{0,6}", fullmatch=True)
    ids = data.draw(st.lists(numbers | names, min_size=n, max_size=n, unique=True), label="ids")
    order = data.draw(st.permutations(ids), label="order")
    c = formed(list(order))
    got = ranks(c)
    assert sorted(got.values()) == list(range(n))
    for node_id, rank in got.items():
        if node_id.isdigit() and int(node_id) < n:
            assert rank == int(node_id)
    # the rank depends on the set of ids, not on the order they came in
    assert got == ranks(formed(sorted(ids)))


# --- failure, re-admission, generations ------------------------------------------------------


def test_failure_of_a_formed_member_marks_it_dead_and_bumps_the_generation():
    c = formed(["a", "b"])
    d = fail(c, "b")
    assert d.mark_dead and d.bump and not d.fail_job
    assert "worker b (rank 1" in d.reason and "exited" in d.reason and "boom" in d.reason
    assert c.nodes["b"].state is m.NodeState.DEAD and c.nodes["b"].failures == 1
    assert (c.generation, c.formed, c.joined) == (2, False, set())
    assert c.job is m.JobState.RUNNING


def test_failure_before_formation_does_not_bump():
    c = m.Cluster(worker_num=2)
    register(c, "a")
    c.joined.add("a")
    d = fail(c, "a")
    assert d.mark_dead and not d.bump
    assert c.generation == 1 and "a" not in c.joined


def test_failure_without_recovery_fails_the_job_with_the_root_cause():
    c = formed(["a", "b"], recovery=False)
    d = fail(c, "a", recovery=False)
    assert d.fail_job and c.job is m.JobState.FAILED and c.root_cause == d.reason
    assert "worker a" in c.root_cause
    later = fail(c, "b", recovery=False)  # the first cause stays the root cause
    assert later.fail_job and c.root_cause == d.reason


def test_dead_node_is_readmitted_at_once_with_the_next_incarnation():
    c = formed(["a", "b"])
    fail(c, "b")
    d, node = register(c, "b", now=2.0, pid=777)
    assert d.action is m.Action.READMIT and d.replaces is None
    assert (node.state, node.incarnation, node.rank, node.pid) == (m.NodeState.ALIVE, 2, 1, 777)
    c.joined.update({"a", "b"})
    assert fm.try_form(c) and c.generation == 2


def test_dead_node_is_not_readmitted_without_recovery():
    c = formed(["a", "b"], recovery=False)
    fail(c, "b")  # recovery on for the decision, so the job is still running
    d, _ = register(c, "b", recovery=False)
    assert d.code is ErrorCode.JOB_OVER and "TG_ENABLE_RECOVERY" in d.reason


def test_new_id_takes_over_the_lowest_dead_rank_when_full():
    c = formed(["0", "1", "2"])
    fail(c, "2")
    fail(c, "1")
    d, node = register(c, "spare-7")
    assert d.action is m.Action.READMIT and d.replaces == "1"
    assert (node.rank, node.incarnation) == (1, 2)
    assert "1" not in c.nodes and c.nodes["spare-7"] is node
    assert ranks(c) == {"0": 0, "spare-7": 1, "2": 2}


def test_stale_incarnation_failure_reports_are_ignored():
    c = formed(["a", "b"])
    fail(c, "b")
    register(c, "b", now=1.0)  # incarnation 2
    c.joined.update({"a", "b"})
    assert fm.try_form(c)
    gen = c.generation
    d = fail(c, "b", incarnation=1)  # about the dead incarnation 1
    assert not (d.mark_dead or d.bump or d.fail_job) and "stale" in d.reason
    assert c.nodes["b"].state is m.NodeState.ALIVE and c.generation == gen and c.formed
    d = fail(c, "nobody")
    assert not (d.mark_dead or d.bump or d.fail_job)


def test_failure_of_an_already_dead_node_changes_nothing():
    c = formed(["a", "b"])
    fail(c, "a")
    d = m.decide_failure(c, "a", None, FailureKind.HEARTBEAT, "", recovery=True)
    assert not (d.mark_dead or d.bump) and "already dead" in d.reason


def test_collective_report_bumps_the_generation_without_killing_the_reporter():
    c = formed(["a", "b"])
    d = fail(c, "a", kind=FailureKind.COLLECTIVE)
    assert not d.mark_dead and d.bump and not d.fail_job
    assert c.nodes["a"].state is m.NodeState.ALIVE and c.generation == 2
    # a second report in the same (unformed) generation does not bump again
    assert not fail(c, "b", kind=FailureKind.COLLECTIVE).bump and c.generation == 2


# --- flapping -----------------------------------------------------------------------------------


def test_node_is_quarantined_after_flap_limit_restarts_in_the_window():
    c = formed(["a", "b"])
    for t in range(1, FLAP + 1):  # FLAP restarts are allowed
        fail(c, "a")
        d, node = register(c, "a", now=float(t))
        assert d.action is m.Action.READMIT, d.reason
    assert node.incarnation == FLAP + 1
    fail(c, "a")
    d, _ = register(c, "a", now=FLAP + 1.0)
    assert d.action is m.Action.REJECT and d.code is ErrorCode.QUARANTINED and d.retry
    assert f"{FLAP} times" in d.reason and "quarantined" in d.reason
    # after the quarantine it is admitted again
    d, node = register(c, "a", now=FLAP + QUARANTINE + 0.5)
    assert d.action is m.Action.READMIT and node.incarnation == FLAP + 2


def test_restarts_spread_beyond_the_window_never_quarantine():
    c = formed(["a"])
    for i in range(3 * FLAP):
        fail(c, "a")
        d, _ = register(c, "a", now=(i + 1) * (m.FLAP_WINDOW_S / (FLAP - 1) + 1))
        assert d.action is m.Action.READMIT, d.reason


# --- formation, expiry, ids ----------------------------------------------------------------------


def test_generation_forms_only_when_all_members_are_alive_and_joined():
    c = m.Cluster(worker_num=3)
    for i in ("a", "b", "c"):
        register(c, i)
    c.joined.update({"a", "b"})
    assert not fm.try_form(c) and all(n.rank == -1 for n in c.nodes.values())
    assert fm.missing_for_formation(c) == "c (alive)"
    c.joined.add("c")
    assert fm.try_form(c) and c.formed
    assert not fm.try_form(c)  # already formed


def test_missing_for_formation_counts_those_never_registered():
    c = m.Cluster(worker_num=3)
    register(c, "a")
    assert fm.missing_for_formation(c) == "a (alive), 2 never registered"


def test_expired_lists_silent_alive_and_unknown_nodes_only():
    c = m.Cluster(worker_num=4)
    for i, t in zip("abcd", (0.0, 8.0, 0.0, 0.0)):
        register(c, i, now=t)
    c.nodes["c"].state = m.NodeState.UNKNOWN
    fail(c, "d")
    assert {n.node_id for n in m.expired(c, now=10.0, timeout=5.0)} == {"a", "c"}
    assert m.expired(c, now=5.0, timeout=5.0) == []


def test_generated_ids_are_unique_and_skip_taken_ones():
    c = m.Cluster(worker_num=4)
    register(c, "auto-2")
    assert [m.generated_id(c) for _ in range(3)] == ["auto-1", "auto-3", "auto-4"]


def test_job_is_done_when_every_worker_finished():
    c = formed(["a", "b"])
    m.apply_finish(c, "a")
    assert c.job is m.JobState.RUNNING and c.nodes["a"].state is m.NodeState.FINISHED
    m.apply_finish(c, "a")  # repeated: no effect
    m.apply_finish(c, "b")
    assert c.job is m.JobState.DONE


def test_local_rank_counts_ranks_on_the_same_host():
    c = m.Cluster(worker_num=4)
    for i, host in zip("0123", ("x", "y", "x", "y")):
        register(c, i, host=host)
        c.joined.add(i)
    assert fm.try_form(c)
    assert [m.local_rank_of(c, c.nodes[i]) for i in "0123"] == [0, 0, 1, 1]


@pytest.mark.parametrize("state", [m.NodeState.DEAD, m.NodeState.FINISHED])
def test_describe_lists_every_node(state):
    c = formed(["b", "a"])
    c.nodes["b"].state = state
    assert c.describe() == f"a(rank 0, alive), b(rank 1, {state.value})"


def test_a_generation_can_never_form_once_a_member_finished_and_left():
    c = m.Cluster(worker_num=3)
    for i in range(3):
        register(c, str(i))
    assert fm.never_forms(c) == ""
    c.nodes["0"].state = m.NodeState.FINISHED
    assert "0 (finished) already left" in fm.never_forms(c)
