"""One all-reduce round of an assembled group: the butterfly scheme.

Without I/O: :mod:`~.round` (``ButterflyRound``, the round's state machine) with its plan,
sending side, decoding, fault handling, recovery of a dead reducer's span and results;
:mod:`~.partition` (the flat vector and its spans), :mod:`~.load_balancing` (span sizes),
:mod:`~.reducer` and :mod:`~.robust` (how a span's contributions are combined),
:mod:`~.members` (what each member tells its group), :mod:`~.early` and :mod:`~.inbox`
(frames on their way to their round). With I/O: :mod:`~.runner` (``AllreduceRunner``,
which drives one round over the node's links).
"""
