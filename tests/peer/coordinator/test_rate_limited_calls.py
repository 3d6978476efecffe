"""One-off calls wait out a coordinator's 429 (``when_allowed``): joining and renewing a
certificate are retried after ``Retry-After`` rather than failing. Time is faked."""

from __future__ import annotations

import httpx
import pytest

from peer.coordinator import CoordinatorClient, RateLimited, when_allowed

HEADER = {"X-Swarmgrad-Coordinator": "1"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_waits_retry_after_and_calls_again() -> None:
    clock = Clock()
    answers: list[object] = [RateLimited("slow down", retry_after=2), RateLimited("x"), "done"]

    def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return str(answer)

    assert when_allowed(call, sleep=clock.sleep, clock=lambda: clock.now) == "done"
    assert clock.slept == [2.0, 1.0]


def test_gives_up_when_the_wait_would_pass_its_patience() -> None:
    clock = Clock()

    def call() -> None:
        raise RateLimited("slow down", retry_after=30)

    with pytest.raises(RateLimited, match="slow down"):
        when_allowed(call, patience=100, sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.slept == [30.0, 30.0, 30.0]


def test_other_errors_are_not_retried() -> None:
    calls = []

    def call() -> None:
        calls.append(1)
        raise ValueError("no")

    with pytest.raises(ValueError):
        when_allowed(call, sleep=lambda s: None)
    assert calls == [1]


def test_a_join_challenge_refused_with_429_is_asked_again() -> None:
    clock = Clock()
    answers = [
        httpx.Response(
            429, json={"detail": "too many join challenges"}, headers={**HEADER, "Retry-After": "3"}
        ),
        httpx.Response(
            200,
            headers=HEADER,
            json={
                "run_id": "r1",
                "run_name": "mnist",
                "task": "digits",
                "status": "running",
                "challenge": "c",
                "expires_at": "2030-01-01T00:00:00Z",
            },
        ),
    ]
    transport = httpx.MockTransport(lambda request: answers.pop(0))
    with CoordinatorClient("http://coordinator", transport=transport) as client:
        challenge = when_allowed(
            lambda: client.join_challenge("sgj_a_b"), sleep=clock.sleep, clock=lambda: clock.now
        )
    assert challenge.run_id == "r1" and clock.slept == [3.0]
