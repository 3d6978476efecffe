"""What a display name may contain and when two are the same (server.services.display_names),
without a coordinator: the API and the invite page are in tests/attacks/test_names.py."""

from __future__ import annotations

import pytest

from server.services.display_names import (
    DisplayNameError,
    clean,
    comparison_key,
    skeleton,
)


@pytest.mark.parametrize(
    ("raw", "stored"),
    [
        ("  Ada  Lovelace ", "Ada Lovelace"),
        ("José", "José"),
        ("Jose\u0301", "José"),  # composed
        ("山田太郎", "山田太郎"),
        ("\uff21\uff44\uff41", "Ada"),  # fullwidth: NFKC
        ("Ada\u00a0L", "Ada L"),  # no-break space: NFKC makes it a space
        ("\u2764\ufe0f", "\u2764\ufe0f"),  # an emoji with its variation selector
    ],
)
def test_names_are_stored_as_nfkc_with_single_spaces(raw: str, stored: str) -> None:
    assert clean(raw) == stored


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("hon\u200best", "U+200B ZERO WIDTH SPACE"),
        ("hon\u200dest", "U+200D ZERO WIDTH JOINER"),
        ("\u202eevil", "U+202E RIGHT-TO-LEFT OVERRIDE"),
        ("a\u2066b", "U+2066 LEFT-TO-RIGHT ISOLATE"),
        ("soft\u00adhyphen", "U+00AD SOFT HYPHEN"),
        ("tab\there", "U+0009"),
        ("line\u2028break", "U+2028 LINE SEPARATOR"),
        ("\u3164", "U+3164 HANGUL FILLER"),
        ("blank\u2800", "U+2800 BRAILLE PATTERN BLANK"),
        ("private\ue000", "U+E000"),
        ("nul\x00", "U+0000"),
    ],
)
def test_invisible_characters_are_refused_by_name(raw: str, named: str) -> None:
    with pytest.raises(DisplayNameError, match="invisible") as refused:
        clean(raw)
    assert named in str(refused.value)


@pytest.mark.parametrize("raw", ["", "   ", "\ufe0f", "x" * 65])
def test_empty_or_long_names_are_refused(raw: str) -> None:
    with pytest.raises(DisplayNameError, match="1 to 64 characters"):
        clean(raw)


@pytest.mark.parametrize(
    "other",
    [
        "HONEST",
        "Honest",
        " honest ",
        "h\u043enest",  # Cyrillic o
        "h\u03bfnest",  # Greek omicron
        "\u04bbonest",  # Cyrillic shha
        "\uff48\uff4f\uff4e\uff45\uff53\uff54",  # fullwidth
        "hon\u200best",  # a name stored before invisible characters were refused
        "honest\ufe0f",
    ],
)
def test_lookalikes_share_the_key(other: str) -> None:
    assert comparison_key(other) == comparison_key("honest")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("paypal", "paypaI"),  # capital i reads as l, though its lower case does not
        ("modern", "rnodern"),  # rn reads as m
        ("Straße", "STRASSE"),
        ("admin", "\u0430dmin"),  # Cyrillic a
    ],
)
def test_confusable_pairs(a: str, b: str) -> None:
    assert comparison_key(a) == comparison_key(b)


@pytest.mark.parametrize(
    ("a", "b"), [("José", "Jose"), ("honest", "hönest"), ("ada", "ada2"), ("山田", "田山")]
)
def test_distinct_names_stay_distinct(a: str, b: str) -> None:
    assert comparison_key(a) != comparison_key(b)


def test_the_skeleton_follows_the_standard_data() -> None:
    # UTS #39 examples: prototypes are what confusables.txt maps to.
    assert skeleton("\u0430") == "a"  # CYRILLIC SMALL LETTER A
    assert skeleton("1") == "l"
    assert skeleton("m") == "rn"
    assert skeleton("\u0399") == "l"  # GREEK CAPITAL LETTER IOTA
    assert skeleton(skeleton("p\u0430ypal")) == skeleton("paypal")
