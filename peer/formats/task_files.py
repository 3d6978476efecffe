"""What a task file shipped with a run may be: the rules the coordinator enforces when an
organizer attaches one and every volunteer checks again before it installs anything.

A shipped task is one Python file (``mytask.py``, at most :data:`MAX_TASK_FILE_BYTES`) and
up to :data:`MAX_REQUIREMENTS` pip requirements, each a package of the index with an
optional version specifier (``numpy>=1.26``, ``transformers[torch]==4.46.0``): no options, no
paths, no URLs. The run's task is then ``module:function`` with ``module`` the file's stem.
Pure functions: no I/O.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "FILENAME_PATTERN",
    "MAX_REQUIREMENTS",
    "MAX_TASK_FILE_BYTES",
    "REQUIREMENT_PATTERN",
    "check_filename",
    "check_requirement",
    "sha256_hex",
    "task_name",
]

# A task file travels base64-encoded in the run's JSON body, whose limit is 1 MiB.
MAX_TASK_FILE_BYTES = 512 * 1024
MAX_REQUIREMENTS = 32
MAX_REQUIREMENT_LENGTH = 200

FILENAME_PATTERN = r"[A-Za-z_]\w{0,99}\.py"
# A name (PEP 508), optional extras, then version specifiers and an environment marker made
# of the characters those use. No "-" first (a pip option), no "/", ":" or "@" (paths, URLs).
REQUIREMENT_PATTERN = (
    r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
    r"(?:\[[A-Za-z0-9._,\- ]*\])?"
    r"[A-Za-z0-9._,<>=!~*;'\"() -]*"
)
_FILENAME = re.compile(FILENAME_PATTERN)
_REQUIREMENT = re.compile(REQUIREMENT_PATTERN)
_FUNCTION = re.compile(r"[A-Za-z_]\w*")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_filename(filename: str) -> str:
    """``filename`` if it names an importable module file (``my_task.py``); else
    ``ValueError`` saying what one looks like."""
    if not _FILENAME.fullmatch(filename):
        raise ValueError(
            f"a task file's name must be a Python module's, like my_task.py, not {filename!r}"
        )
    return filename


def check_requirement(spec: str) -> str:
    """``spec`` stripped, if it is a requirement a volunteer may install; else
    ``ValueError`` saying why."""
    text = spec.strip()
    if not text or len(text) > MAX_REQUIREMENT_LENGTH:
        raise ValueError(
            f"a requirement is 1 to {MAX_REQUIREMENT_LENGTH} characters, like numpy>=1.26"
        )
    if not _REQUIREMENT.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a requirement of the package index (like numpy>=1.26; "
            "no pip options, paths or URLs)"
        )
    return text


def task_name(filename: str, function: str) -> str:
    """The run's task for ``function`` of the file: ``"my_task:make"``."""
    check_filename(filename)
    if not _FUNCTION.fullmatch(function):
        raise ValueError(f"a task function must be a Python identifier, not {function!r}")
    return f"{filename[:-3]}:{function}"
