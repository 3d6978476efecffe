"""Display names as people read them: what a name may contain, and when two are the same.

:func:`clean` prepares a name as RFC 8266 prepares nicknames (NFKC, spaces collapsed and
trimmed) and refuses what a reader cannot see: control, format, private-use, unassigned and
other default-ignorable code points (variation selectors pass but count for nothing).

:func:`comparison_key` says when two names are the same: equal after NFKC, case folding and
the confusable skeleton of Unicode Technical Standard #39 (taken before and after folding),
so ``honest``, ``HONEST`` and ``h\\u043enest`` are one name, and ``paypaI`` is ``paypal``. The
confusables data is the ``confusable_homoglyphs`` package's.

Pure functions: no database, no I/O beyond reading that package's data once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import unicodedata
from importlib import resources

from peer.formats.requests import MAX_DISPLAY_NAME_LENGTH as MAX_LENGTH

# Default_Ignorable_Code_Point (Unicode DerivedCoreProperties.txt) outside the categories
# refused as a whole (Cf, Cn), plus U+2800 BRAILLE PATTERN BLANK, a visible-width blank used
# in place of an ignorable.
_INVISIBLE_RANGES = (
    (0x034F, 0x034F),  # COMBINING GRAPHEME JOINER
    (0x115F, 0x1160),  # HANGUL CHOSEONG/JUNGSEONG FILLER
    (0x17B4, 0x17B5),  # KHMER VOWEL INHERENT AQ/AA
    (0x180B, 0x180F),  # MONGOLIAN FREE VARIATION SELECTORS (and U+180E VOWEL SEPARATOR)
    (0x2800, 0x2800),  # BRAILLE PATTERN BLANK
    (0x3164, 0x3164),  # HANGUL FILLER
    (0xFFA0, 0xFFA0),  # HALFWIDTH HANGUL FILLER
)
_VARIATION_SELECTORS = ((0xFE00, 0xFE0F), (0xE0100, 0xE01EF))
# Control, format, surrogate, private use, unassigned; line and paragraph separators.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Marks that show right-to-left text left-to-right in confusables.txt's comments, which the
# package's data keeps around some characters; never part of a character itself.
_DIRECTION_MARKS = str.maketrans("", "", "\u200e\u200f")


class DisplayNameError(ValueError):
    """The name cannot be used; ``str(exc)`` says why, in words for the person choosing it."""


def _within(code: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(low <= code <= high for low, high in ranges)


def is_variation_selector(char: str) -> bool:
    return _within(ord(char), _VARIATION_SELECTORS)


def _hidden(char: str) -> bool:
    return not is_variation_selector(char) and (
        unicodedata.category(char) in _REFUSED_CATEGORIES or _within(ord(char), _INVISIBLE_RANGES)
    )


def is_invisible(char: str) -> bool:
    """Whether ``char`` is refused in a display name after NFKC (variation selectors are
    not; nor is the plain space)."""
    return _hidden(char) or (char.isspace() and char != " ")


def _describe(char: str) -> str:
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" {name}" if name else "")


def clean(raw: str) -> str:
    """The name to store for ``raw``: NFKC, runs of spaces made one, trimmed.
    :class:`DisplayNameError` if it contains an invisible character (:func:`is_invisible`),
    is empty, or is longer than :data:`MAX_LENGTH` characters."""
    name = unicodedata.normalize("NFKC", raw)
    # Named as typed where it was typed (NFKC turns some into others), else as normalised:
    # a space NFKC does not make a plain one (U+1680 OGHAM SPACE MARK) is refused too.
    refused = [c for c in raw if _hidden(c)] or [c for c in name if is_invisible(c)]
    if refused:
        raise DisplayNameError(
            "a display name may not contain invisible, control or formatting characters "
            f"({_describe(refused[0])})"
        )
    name = " ".join(part for part in name.split(" ") if part)
    visible = [c for c in name if not is_variation_selector(c)]
    if not visible or len(name) > MAX_LENGTH:
        raise DisplayNameError(f"a display name has 1 to {MAX_LENGTH} characters")
    return name


@functools.cache
def _prototypes() -> dict[str, str]:
    """Each confusable character -> its prototype (one or more characters).

    ``confusables.txt`` maps each source character to one prototype, which is never itself
    a source; the package keeps each line in both directions, so every class is a star
    around its prototype. The prototype is the member of several characters (sources are
    single code points), else the one with more than one neighbour; a class of exactly two
    single characters is mapped to its smaller member, which gives names the same key
    exactly when their skeletons are equal."""
    data = resources.files("confusable_homoglyphs").joinpath("confusables.json")
    raw: dict[str, list[dict[str, str]]] = json.loads(data.read_text(encoding="utf-8"))
    neighbours: dict[str, set[str]] = {}
    for key, entries in raw.items():
        a = key.translate(_DIRECTION_MARKS)
        for entry in entries:
            b = entry["c"].translate(_DIRECTION_MARKS)
            if a and b and a != b:
                neighbours.setdefault(a, set()).add(b)
                neighbours.setdefault(b, set()).add(a)
    prototypes: dict[str, str] = {}
    for char, around in neighbours.items():
        if len(char) != 1 or len(around) != 1:
            continue  # a prototype (or a string of several characters): maps to itself
        (other,) = around
        # Towards the prototype; in a class of two single characters, the smaller one.
        if len(other) > 1 or len(neighbours[other]) > 1 or other < char:
            prototypes[char] = other
    return prototypes


def skeleton(text: str) -> str:
    """The UTS #39 skeleton: NFD, each character replaced by its prototype, NFD again."""
    prototypes = _prototypes()
    decomposed = unicodedata.normalize("NFD", text)
    return unicodedata.normalize("NFD", "".join(prototypes.get(c, c) for c in decomposed))


def comparison_key(name: str) -> str:
    """A short fixed-length key, equal for two names exactly when a reader could take one
    for the other: NFKC, variation selectors and invisible characters dropped (a name stored
    before they were refused still collides with its visible form), skeleton, case folding,
    skeleton again."""
    text = unicodedata.normalize("NFKC", name)
    text = "".join(c for c in text if c == " " or not (is_invisible(c) or is_variation_selector(c)))
    text = " ".join(part for part in text.split(" ") if part)
    text = skeleton(unicodedata.normalize("NFKC", skeleton(text).casefold()))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()
