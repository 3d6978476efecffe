"""Averaging: protocol logic without I/O (partition, reducer, load balancing, matchmaking,
Moshpit group bits) and, one layer up, the networked ``DecentralizedAverager``.

The pure modules are importable on their own and never touch sockets, clocks or loops:
:mod:`~peer.averaging.partition`, :mod:`~peer.averaging.reducer`,
:mod:`~peer.averaging.load_balancing`, :mod:`~peer.averaging.matchmaking`,
:mod:`~peer.averaging.group_bits`; errors in :mod:`~peer.averaging.exceptions`.
"""
