"""Matchmaking: which peers average together in a round.

Without I/O: :mod:`~.machine` (``Matchmaker``, the state machine) and :mod:`~.attempt`
(one attempt's bookkeeping), their vocabulary in :mod:`~.messages`, and the group keys
peers look for each other under (:mod:`~.group_bits`, Moshpit's; :mod:`~.grid`, grids that
fit any swarm size). With I/O: :mod:`~.driver`, which runs the machine over the network.
"""
