"""Integrations with training frameworks; each imports its framework only when used.

* :mod:`peer.integrations.lightning` — ``SwarmgradStrategy`` for Lightning's ``Trainer``
  (the ``swarmgrad[lightning]`` extra).
"""
