"""The restore decision (control/restore_plan.py) for every interleaving of the commit-or-skip protocol
(docs/ARCHITECTURE.md's table): pure, no sockets."""

from trainguard.control.restore_plan import choose_restore


def sources(d):
    return {int(r): (s["kind"], s.get("peer")) for r, s in d["sources"].items()}


def test_peer_dies_before_the_exchange_everyone_skips_and_the_replacement_takes_the_common_step():
    d = choose_restore({0: {"step": 7}, 1: {"step": None}, 2: {"step": 7}})
    assert d["step"] == 7 and d["from_step"] == 7
    assert sources(d) == {0: ("self", None), 1: ("peer", 0), 2: ("self", None)}


def test_exchange_completed_on_some_ranks_only_the_newest_wins_and_nobody_rolls_back():
    d = choose_restore({0: {"step": 8}, 1: {"step": None}, 2: {"step": 7}, 3: {"step": 8}})
    assert d["step"] == 8
    assert sources(d) == {0: ("self", None), 1: ("peer", 0), 2: ("peer", 3), 3: ("self", None)}


def test_the_holder_of_the_newest_state_dies_the_survivors_step_is_redone():
    d = choose_restore({0: {"step": 7}, 1: {"step": None}, 2: {"step": 7}})  # rank 1 had committed 8
    assert d["step"] == 7


def test_two_ranks_die_both_take_the_state_from_survivors():
    d = choose_restore({0: {"step": None}, 1: {"step": 9}, 2: {"step": None}, 3: {"step": 9}})
    assert sources(d) == {0: ("peer", 1), 1: ("self", None), 2: ("peer", 3), 3: ("self", None)}


def test_no_live_state_the_newest_common_disk_step_then_fresh():
    d = choose_restore({0: {"step": None, "disk": [4, 8]}, 1: {"step": None, "disk": [4]}})
    assert d["step"] == 4 and {s["kind"] for s in d["sources"].values()} == {"disk"}
    d = choose_restore({0: {"step": None}, 1: {"step": None}})
    assert d["fresh"] and {s["kind"] for s in d["sources"].values()} == {"init"}


def test_disk_steps_that_no_step_joins_are_an_error_not_a_silent_restart():
    d = choose_restore({0: {"step": None, "disk": [8]}, 1: {"step": None, "disk": [4]}})
    assert d["step"] is None and "no step can be restored" in d["error"]
