"""The restore decision (control/restore_plan.py) for every interleaving of the commit-or-skip protocol
(docs/ARCHITECTURE.md's table): pure, no sockets."""

from trainguard.control import restore_plan
from trainguard.control.reports import RestoreReport


def choose_restore(reports: dict, known_step: int = 0):
    """The plan from reports written as dicts ("disk" defaults to none)."""
    typed = {r: RestoreReport(**({"disk": []} | rep)) for r, rep in reports.items()}
    return restore_plan.choose_restore(typed, known_step)


def sources(d):
    return {r: (s.kind.value, s.peer) for r, s in enumerate(d.sources)}


def kinds(d):
    return {s.kind.value for s in d.sources}


def test_peer_dies_before_the_exchange_everyone_skips_and_the_replacement_takes_the_common_step():
    d = choose_restore({0: {"step": 7}, 1: {"step": None}, 2: {"step": 7}})
    assert d.step == 7 and d.from_step == 7
    assert sources(d) == {0: ("self", None), 1: ("peer", 0), 2: ("self", None)}


def test_exchange_completed_on_some_ranks_only_the_newest_wins_and_nobody_rolls_back():
    d = choose_restore({0: {"step": 8}, 1: {"step": None}, 2: {"step": 7}, 3: {"step": 8}})
    assert d.step == 8
    assert sources(d) == {0: ("self", None), 1: ("peer", 0), 2: ("peer", 3), 3: ("self", None)}


def test_the_holder_of_the_newest_state_dies_the_survivors_step_is_redone():
    d = choose_restore({0: {"step": 7}, 1: {"step": None}, 2: {"step": 7}})  # rank 1 had committed 8
    assert d.step == 7


def test_two_ranks_die_both_take_the_state_from_survivors():
    d = choose_restore({0: {"step": None}, 1: {"step": 9}, 2: {"step": None}, 3: {"step": 9}})
    assert sources(d) == {0: ("peer", 1), 1: ("self", None), 2: ("peer", 3), 3: ("self", None)}


def test_no_live_state_the_newest_common_disk_step_then_fresh():
    d = choose_restore({0: {"step": None, "disk": [4, 8]}, 1: {"step": None, "disk": [4]}})
    assert d.step == 4 and kinds(d) == {"disk"}
    d = choose_restore({0: {"step": None}, 1: {"step": None}})
    assert d.fresh and kinds(d) == {"init"}


def test_disk_steps_that_no_step_joins_are_an_error_not_a_silent_restart():
    d = choose_restore({0: {"step": None, "disk": [8]}, 1: {"step": None, "disk": [4]}})
    assert d.step is None and "no step can be restored" in d.error


def test_a_fresh_start_after_committed_steps_is_an_error_not_a_silent_restart():
    reports = {r: {"step": None, "disk": []} for r in range(3)}
    assert choose_restore(reports).source(0).kind.value == "init"  # a new job: a fresh start
    decision = choose_restore(reports, known_step=40)
    assert decision.step is None and "committed 40 steps" in decision.error
    assert "TG_CHECKPOINT_DIR" in decision.error


def test_a_restore_from_disk_below_the_known_step_says_what_is_lost():
    reports = {r: {"step": None, "disk": [10, 20]} for r in range(3)}
    decision = choose_restore(reports, known_step=27)
    assert (decision.step, decision.from_step, decision.lost_steps) == (20, 27, 7)
    live = choose_restore({0: {"step": 26}, 1: {"step": 27}}, known_step=28)
    assert (live.step, live.from_step) == (27, 27)  # live state: the survivors' step, as before
