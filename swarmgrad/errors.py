"""The command line's own failure, beside the peer library's (:mod:`peer.exceptions`)::

    SwarmgradError                 (peer.exceptions)
    └── CommandError               a command cannot do what was asked: no checkpoint yet, a
                                   local coordinator or volunteer process that failed

    typer.BadParameter             (click's usage errors)
    └── UsageError                 a usage mistake in our own words (no organizer token)

:func:`swarmgrad.cli.main` prints any of them as one line ``error: ...`` and exits 1 (2 for a
usage error).
"""

from __future__ import annotations

import typer

from peer.exceptions import SwarmgradError


class CommandError(SwarmgradError):
    """A command cannot do what was asked; ``str()`` is one line for the person at the terminal."""


class UsageError(typer.BadParameter):
    """A usage mistake told in our own words (exit status 2, like click's own usage errors):
    ``str()`` is printed as is, without click's "Invalid value for ..." frame."""

    def format_message(self) -> str:
        return self.message
