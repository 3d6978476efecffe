"""What a run trains: :class:`Task` objects, named by :func:`load_task`.

* :mod:`peer.tasks.base` — the :class:`Task` interface, :class:`TrainingConfig` (a run's
  config checked against its task) and :class:`TaskError`;
* :mod:`peer.tasks.registry` — :func:`load_task`: ``"digits"``, ``"charlm"`` or
  ``"package.module:function"``;
* :mod:`peer.tasks.digits` — scikit-learn's bundled digits, an MLP (and the benchmark's
  single-process and DecentralizedSGD trainers);
* :mod:`peer.tasks.charlm` — a byte-level transformer language model of a text in Python's
  standard library.

Both built-ins need no download. Importing this package does not import torch.
"""

from __future__ import annotations

from peer.tasks.base import Task, TaskError, TrainingConfig
from peer.tasks.registry import load_task

__all__ = ["Task", "TaskError", "TrainingConfig", "load_task"]
