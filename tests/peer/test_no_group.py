"""The volunteer's own "no group for N rounds" line, from its optimizer's counters and the
gossip membership, without sockets; and where the epoch line shows it."""

from __future__ import annotations

from peer.optim.no_group import NO_GROUP_ROUNDS, NoGroupWatch
from peer.volunteer import VolunteerStatus
from swarmgrad.join import epoch_line


def test_rounds_without_a_group_while_others_are_online_are_said_with_what_helps() -> None:
    watch = NoGroupWatch()

    def failed(rounds: int) -> str | None:
        return watch.observe(
            epoch=rounds, rounds_done=0, rounds_failed=rounds, peers_online=3, path="dialing out"
        )

    assert [failed(n) for n in range(NO_GROUP_ROUNDS)] == [None] * NO_GROUP_ROUNDS
    line = failed(NO_GROUP_ROUNDS)
    assert line is not None
    assert line.startswith(f"no group for {NO_GROUP_ROUNDS} rounds while 2 other peers are online")
    assert "no other peer can reach this machine" in line and "forward a port" in line


def test_epochs_stepped_alone_count_as_rounds_and_a_completed_round_clears_the_line() -> None:
    watch = NoGroupWatch()
    watch.observe(epoch=10, rounds_done=4, rounds_failed=1, peers_online=2, path="public")
    line = watch.observe(epoch=15, rounds_done=4, rounds_failed=1, peers_online=2, path="public")
    assert line is not None and line.startswith("no group for 5 rounds while 1 other peer is")
    assert "links to the other peers fail" in line
    assert (
        watch.observe(epoch=16, rounds_done=5, rounds_failed=1, peers_online=2, path="public")
        is None
    )
    assert (
        watch.observe(epoch=17, rounds_done=5, rounds_failed=2, peers_online=2, path="public")
        is None
    )


def test_alone_in_the_run_is_not_a_missing_group() -> None:
    watch = NoGroupWatch()
    watch.observe(epoch=0, rounds_done=0, rounds_failed=0, peers_online=1, path="unreachable")
    assert watch.observe(epoch=9, rounds_done=0, rounds_failed=9, peers_online=1, path=None) is None
    line = watch.observe(epoch=9, rounds_done=0, rounds_failed=9, peers_online=4, path=None)
    assert line is not None and "no link to any other peer" in line  # no path yet: the worst


def test_the_epoch_line_ends_with_it() -> None:
    status = VolunteerStatus(epoch=4, path="dialing out", no_group="no group for 3 rounds ...")
    assert epoch_line(status).endswith("| coordinator ok | no group for 3 rounds ...")
    assert "no group" not in epoch_line(VolunteerStatus(epoch=4))
