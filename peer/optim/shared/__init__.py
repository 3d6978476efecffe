"""What the optimizers share: the swarm's progress (:mod:`~.progress`), epochs claimed
without a state behind them (:mod:`~.claims`), catching up with the swarm (:mod:`~.catchup`,
and :mod:`~.live_catchup` for an optimizer with a live state), the live state itself
(:mod:`~.live_state`, :mod:`~.optimizer_state`) and the background run in flight
(:mod:`~.pending`).
"""
