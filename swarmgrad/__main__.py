"""``python -m swarmgrad``: the same as the ``swarmgrad`` command."""

from swarmgrad.cli import main

main()
