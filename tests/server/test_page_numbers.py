"""What the pages' numbers rest on, without a browser: the time to target leaves pauses out,
relative times grow, and the credential a browser keeps opens only for its own invite, unaltered
and in time."""

from __future__ import annotations

import pytest

from server.services.dashboard import eta_seconds
from server.web import formatting
from server.web.credential_cookie import KEEP_S, CredentialSeal, KeptCredential


def test_the_time_to_target_leaves_a_pause_out() -> None:
    steady = [0, 10_000, 20_000, 30_000, 40_000, 50_000]  # 10 s per epoch
    assert eta_seconds(5, 15, steady) == pytest.approx(100.0)
    # Paused for 20 minutes during epoch 3: one long gap among five, the pace is unchanged.
    paused = [0, 10_000, 20_000, 1_220_000, 1_230_000, 1_240_000]
    assert eta_seconds(5, 15, paused) == pytest.approx(100.0)
    # While paused the estimate stands still: it depends on epochs, not on the clock.
    assert eta_seconds(5, 15, paused) == eta_seconds(5, 15, paused)
    assert eta_seconds(5, 15, [0, 0, 0]) is None
    # Running with nobody online: no progress, so no time is promised (a reached target stays 0).
    assert eta_seconds(5, 15, steady, stalled=True) is None
    assert eta_seconds(15, 15, steady, stalled=True) == 0.0


def test_relative_times_and_durations_grow() -> None:
    assert [formatting.ago(s) for s in (0, 9.9, 10, 59, 60, 3599, 3600, 86400)] == [
        "just now",
        "just now",
        "10 s ago",
        "59 s ago",
        "1 min ago",
        "59 min ago",
        "1 h ago",
        "1 d ago",
    ]
    assert [formatting.duration(s) for s in (0.4, 45, 60, 3660, 90000)] == [
        "0 s",
        "45 s",
        "1 min",
        "1 h 1 min",
        "1 d 1 h",
    ]
    assert formatting.rate(47108.4) == "47,108" and formatting.integer(12544) == "12,544"


def test_a_kept_credential_opens_only_for_its_invite_unaltered_and_in_time() -> None:
    seal = CredentialSeal("s" * 48)
    kept = KeptCredential(7, "sgj_abc_secret")
    text = seal.seal("invite1", kept, now=1000.0)
    assert seal.open("invite1", text, now=1000.0 + KEEP_S - 1) == kept
    assert seal.open("invite2", text, now=1000.0) is None  # another invite's cookie
    assert seal.open("invite1", text, now=1000.0 + KEEP_S + 1) is None  # too old
    assert CredentialSeal("t" * 48).open("invite1", text, now=1000.0) is None  # another key
    flipped = text[:20] + ("A" if text[20] != "A" else "B") + text[21:]
    assert seal.open("invite1", flipped, now=1000.0) is None
    assert seal.open("invite1", None) is None and seal.open("invite1", "%%%") is None
