"""Averaging: protocol logic without I/O (partition, reducer, load balancing, matchmaking,
Moshpit group bits) and, one layer up, the networked ``DecentralizedAverager``.

The pure modules are importable on their own and never touch sockets, clocks or loops:
:mod:`~peer.averaging.allreduce.partition`, :mod:`~peer.averaging.allreduce.reducer`,
:mod:`~peer.averaging.allreduce.load_balancing`, :mod:`~peer.averaging.matchmaking.machine`,
:mod:`~peer.averaging.matchmaking.group_bits`; errors in :mod:`~peer.averaging.exceptions`.
"""
