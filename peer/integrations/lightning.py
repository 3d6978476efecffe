"""``SwarmgradStrategy``: train a ``LightningModule`` collaboratively with ``peer.Optimizer``.

Hand it to a ``Trainer`` and every machine that runs the same script joins one swarm::

    trainer = Trainer(strategy=SwarmgradStrategy(target_batch_size=4096))
    trainer.fit(model)   # logs the line another machine runs to join

Arguments and behaviour follow Lightning's ``HivemindStrategy``: the module's optimizer is
wrapped by a collaborative :class:`~peer.Optimizer` that steps once the whole swarm has
processed ``target_batch_size`` samples; ``batch_size`` (the samples behind each local
step) is read from the first batch when not given; schedulers step on swarm epochs.
Options that re-create the optimizer (``offload_optimizer``, ``delay_optimizer_step``,
``delay_state_averaging``) need ``scheduler_fn`` for a scheduler. Peers are found through
``initial_peers`` (or the ``PL_INITIAL_PEERS`` environment variable, comma-separated);
``host`` and ``port`` are where this machine's node listens (hivemind's ``host_maddrs`` maps
onto them; its other DHT options are refused at construction where they have no counterpart:
:mod:`peer.integrations.hivemind_options`). Other keyword arguments go to
:class:`~peer.Optimizer` unchanged (``grad_compression``, ``average_state_every``, ...).
For ``pytorch_lightning.Trainer``, import the strategy from
:mod:`peer.integrations.pytorch_lightning`: the same class for the other package (both are
:class:`~peer.integrations.lightning_strategy.SwarmgradStrategyBase` on their package's
``Strategy``).

``algorithm="diloco"`` trains with :class:`~peer.DiLoCo` instead (no ``target_batch_size``):
the module's optimizer takes ``inner_steps`` local steps, then the swarm averages the
pseudo-gradient and an outer step follows; ``inner_steps``, ``fragments``, ``compression``,
``overlap`` and ``outer_optimizer`` are passed as keyword arguments.

With ``coordinator=URL`` and ``token=T`` (an invite token, as ``swarmgrad join`` takes) the
strategy joins that coordinator's run instead: it proves it holds this machine's key (kept
in ``data_dir``, by default the volunteer's), gets a run certificate and the run's peers,
checks whether others can dial it, uses the run's id, and sends progress reports (epoch,
samples, loss, averaging rounds) that show on the run's dashboard. ``name`` is the display
name. The run's task and config do not apply: the ``LightningModule`` is the model.

Needs the ``lightning`` package: ``pip install 'swarmgrad[lightning]'``.
"""

from __future__ import annotations

from peer.exceptions import SwarmgradError

try:
    from lightning.pytorch.strategies import Strategy
except ModuleNotFoundError:
    raise SwarmgradError(
        "SwarmgradStrategy needs Lightning: pip install 'swarmgrad[lightning]'"
    ) from None

from peer.integrations.lightning_strategy import (
    LightningPackage,
    SwarmgradStrategyBase,
    SwarmScheduler,
)

__all__ = ["SwarmScheduler", "SwarmgradStrategy"]


class SwarmgradStrategy(SwarmgradStrategyBase, Strategy):
    """Collaborative training across the swarm, for ``lightning.pytorch.Trainer`` (see the
    module docstring)."""

    lightning_package = LightningPackage.load("lightning.pytorch")
