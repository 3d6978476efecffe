"""Logic of the command line without I/O: option parsing, the error line, the log lines of
``swarmgrad join --quiet``."""

from __future__ import annotations

import io

import pytest

from peer.formats.durations import parse_duration
from peer.volunteer import VolunteerStatus
from swarmgrad.cli import error_line
from swarmgrad.join import LineDisplay, epoch_line
from swarmgrad.organizer import parse_config


def test_config_values_are_json_when_they_parse_else_strings() -> None:
    assert parse_config(
        ["lr=0.05", "epochs=40", "optimizer=adam", "nesterov=true", "sizes=[1, 2]", "x="]
    ) == {"lr": 0.05, "epochs": 40, "optimizer": "adam", "nesterov": True, "sizes": [1, 2], "x": ""}
    assert parse_config(["name=a=b", "lr=1", "lr=2"]) == {"name": "a=b", "lr": 2}
    assert parse_config(['quoted="7"']) == {"quoted": "7"}


@pytest.mark.parametrize("item", ["lr", "=3", " =3"])
def test_a_config_item_without_key_is_a_usage_error(item: str) -> None:
    import typer

    with pytest.raises(typer.BadParameter, match="key=value"):
        parse_config([item])


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30m", 1800), ("12h", 43200), ("7d", 604800), ("45s", 45), ("2w", 1209600), ("1.5h", 5400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7 days", "-1h", "0m", "1y"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="30m, 12h or 7d"):
        parse_duration(text)


def test_error_line_is_one_line() -> None:
    assert error_line("cannot\n  reach   it\n") == "error: cannot reach it"
    assert error_line("") == "error: unknown error"


def status(**fields: object) -> VolunteerStatus:
    return VolunteerStatus(**fields)  # type: ignore[arg-type]


def test_epoch_line_has_epoch_then_samples() -> None:
    line = epoch_line(
        status(
            state="training",
            epoch=12,
            samples=3456,
            samples_per_second=210.51,
            swarm_samples_per_second=830.1,
            loss=0.4123,
            eval_metric=0.9131,
            metric_name="accuracy",
            peers_online=4,
            group_size=4,
        )
    )
    assert line == (
        "epoch 12 | samples 3456 | 210.5 samples/s (swarm 830.1) | loss 0.412 | "
        "accuracy 0.913 | peers 4 | group 4 | coordinator ok"
    )
    bare = epoch_line(status(epoch=0, samples=1, coordinator_reachable=False))
    assert bare == (
        "epoch 0 | samples 1 | - samples/s (swarm -) | loss - | peers 0 | group - | "
        "coordinator unreachable"
    )


def test_quiet_display_prints_a_line_per_new_epoch_and_per_event() -> None:
    out = io.StringIO()
    display = LineDisplay(out)
    display.update(status(state="joining"))
    display.update(status(state="loading", reachability="reachable at ws://1.2.3.4:5"))
    display.update(status(state="training"))  # no sample yet: no epoch line
    display.update(status(state="training", epoch=0, samples=32))
    display.update(status(state="training", epoch=0, samples=64))  # same epoch
    display.update(status(state="training", epoch=2, samples=96, message="the run resumed"))
    display.update(status(state="finished", epoch=2, samples=96, message="the run is finished"))
    display.final("the run is finished")  # said already
    display.note("leaving the run")
    lines = out.getvalue().splitlines()
    assert lines[0] == "reachable at ws://1.2.3.4:5"
    assert lines[1].startswith("epoch 0 | samples 32 |")
    assert lines[2] == "the run resumed"
    assert lines[3].startswith("epoch 2 | samples 96 |")
    assert lines[4:] == ["the run is finished", "leaving the run"]
