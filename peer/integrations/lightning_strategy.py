"""The one implementation of ``SwarmgradStrategy``, for either Lightning package.

``lightning.pytorch`` and ``pytorch_lightning`` ship the same Trainer under two names, each
accepting only strategies derived from its own ``Strategy``. :class:`SwarmgradStrategyBase`
holds every method and derives from neither; each package's strategy mixes it into that
package's ``Strategy``, with the Lightning helpers it calls taken from that same package
(:class:`LightningPackage`)::

    class SwarmgradStrategy(SwarmgradStrategyBase, pytorch_lightning.strategies.Strategy):
        lightning_package = LightningPackage.load("pytorch_lightning")

:mod:`peer.integrations.lightning` and :mod:`peer.integrations.pytorch_lightning` are those
two declarations. This module imports no Lightning package itself.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch.optim.lr_scheduler import LRScheduler

from peer.exceptions import NodeShutdown
from peer.formats.payloads import DEFAULT_REPORT_INTERVAL_S
from peer.integrations.hivemind_options import map_dht_options

if TYPE_CHECKING:
    # What the type checker checks the methods against; at run time the base is each
    # package's Strategy, which the subclass names after this class.
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy as _Strategy

    from peer.coordinator.joining import Membership
    from peer.coordinator.reports import OptimizerReports
    from peer.data_dir import DataDirLock
    from peer.formats.open_types import StateDict
    from peer.node import Node
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.diloco.outer import DiLoCo
else:
    _Strategy = object

log = logging.getLogger("peer.integrations.lightning")

REPORT_INTERVAL_S = (
    DEFAULT_REPORT_INTERVAL_S  # progress reports to a coordinator, at most this often
)

__all__ = ["LightningPackage", "SwarmScheduler", "SwarmgradStrategyBase"]

T = TypeVar("T")


@dataclass
class LightningPackage:
    """What the strategy uses of one Lightning package (``lightning.pytorch`` or
    ``pytorch_lightning``), each taken from that package."""

    name: str
    strategy: type
    extract_batch_size: Callable[[object], int]
    misconfiguration: type[Exception]
    is_overridden: Callable[[str, object], bool]
    rank_zero_warn: Callable[[str], None]

    @classmethod
    def load(cls, name: str) -> LightningPackage:
        """The package ``name``; ``ModuleNotFoundError`` when it is not installed."""

        def module(path: str) -> ModuleType:
            return importlib.import_module(f"{name}.{path}")

        return cls(
            name=name,
            strategy=module("strategies").Strategy,
            extract_batch_size=module("utilities.data").extract_batch_size,
            misconfiguration=module("utilities.exceptions").MisconfigurationException,
            is_overridden=module("utilities.model_helpers").is_overridden,
            rank_zero_warn=module("utilities.rank_zero").rank_zero_warn,
        )


class SwarmgradStrategyBase(_Strategy):
    """Collaborative training across the swarm (see :mod:`peer.integrations.lightning`), for
    the Lightning package of :attr:`lightning_package`; a subclass also derives from that
    package's ``Strategy`` (checked when the subclass is declared).

    Arguments and behaviour follow Lightning's ``HivemindStrategy``: the module's optimizer
    is wrapped by a collaborative :class:`~peer.Optimizer` that steps once the whole swarm
    has processed ``target_batch_size`` samples; ``batch_size`` (the samples behind each
    local step) is read from the first batch when not given; schedulers step on swarm
    epochs. Options that re-create the optimizer (``offload_optimizer``,
    ``delay_optimizer_step``, ``delay_state_averaging``) need ``scheduler_fn`` for a
    scheduler. Peers are found through ``initial_peers`` (or the ``PL_INITIAL_PEERS``
    environment variable, comma-separated); ``host`` and ``port`` are where this machine's
    node listens (hivemind's ``host_maddrs`` maps onto them; its other DHT options are
    refused at construction where they have no counterpart:
    :mod:`peer.integrations.hivemind_options`). Other keyword arguments go to
    :class:`~peer.Optimizer` unchanged (``grad_compression``, ``average_state_every``, ...).

    ``algorithm="diloco"`` trains with :class:`~peer.DiLoCo` instead (no
    ``target_batch_size``): the module's optimizer takes ``inner_steps`` local steps, then
    the swarm averages the pseudo-gradient and an outer step follows; ``inner_steps``,
    ``fragments``, ``compression``, ``overlap`` and ``outer_optimizer`` are passed as
    keyword arguments.

    With ``coordinator=URL`` and ``token=T`` (an invite token, as ``swarmgrad join`` takes)
    the strategy joins that coordinator's run instead: it proves it holds this machine's key
    (kept in ``data_dir``, by default the volunteer's), gets a run certificate and the run's
    peers, checks whether others can dial it, uses the run's id, and sends progress reports
    (epoch, samples, loss, averaging rounds) that show on the run's dashboard. ``name`` is
    the display name. The run's task and config do not apply: the ``LightningModule`` is the
    model.
    """

    lightning_package: ClassVar[LightningPackage]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        package = cls.__dict__.get("lightning_package")
        if package is not None and not issubclass(cls, package.strategy):
            raise TypeError(
                f"{cls.__name__} runs under {package.name}'s Trainer, so it derives from "
                f"{package.name}.strategies.Strategy as well"
            )

    INITIAL_PEERS_ENV: str = "PL_INITIAL_PEERS"

    def __init__(
        self,
        target_batch_size: int | None = None,
        run_id: str = "lightning_run",
        batch_size: int | None = None,
        delay_state_averaging: bool = False,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        offload_optimizer: bool | None = None,
        reuse_grad_buffers: bool = False,
        scheduler_fn: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        verbose: bool = False,
        averager_opts: dict[str, Any] | None = None,
        host: str = "0.0.0.0",
        port: int = 0,
        initial_peers: str | list[str] | None = None,
        node: Node | None = None,
        coordinator: str | None = None,
        token: str | None = None,
        name: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        algorithm: str = "collaborative",
        **optimizer_kwargs: Any,  # the optimizer's (peer.Optimizer or peer.DiLoCo), passed on
    ) -> None:
        super().__init__()
        if algorithm not in ("collaborative", "diloco"):
            raise ValueError(f"algorithm is 'collaborative' or 'diloco', not {algorithm!r}")
        if algorithm == "collaborative" and target_batch_size is None:
            raise ValueError("the collaborative optimizer needs a target_batch_size")
        collaborative_only = dict(
            delay_state_averaging=delay_state_averaging,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            offload_optimizer=offload_optimizer,
            reuse_grad_buffers=reuse_grad_buffers,
        )
        if algorithm == "diloco" and any(collaborative_only.values()):
            raise ValueError(
                "algorithm='diloco' overlaps rounds with overlap=True; the collaborative "
                "optimizer's delay_*, offload_optimizer and reuse_grad_buffers do not apply"
            )
        self._algorithm = algorithm
        # hivemind's DHT options (host_maddrs, use_ipfs, ...): mapped or refused here, not
        # passed on to the optimizer to fail at the first batch
        host, port = map_dht_options(host, port, optimizer_kwargs)
        self._target_batch_size = target_batch_size
        self._batch_size = batch_size
        self._scheduler_fn = scheduler_fn
        self._require_scheduler_fn = bool(
            delay_optimizer_step or delay_state_averaging or offload_optimizer
        )
        self._run_id = run_id
        self._reuse_grad_buffers = reuse_grad_buffers
        self._optimizer_kwargs: dict[str, Any] = dict(
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            delay_optimizer_step=delay_optimizer_step,
            delay_state_averaging=delay_state_averaging,
            delay_grad_averaging=delay_grad_averaging,
            offload_optimizer=offload_optimizer,
            averager_opts=averager_opts,
            verbose=verbose,
            reuse_grad_buffers=reuse_grad_buffers,
            **optimizer_kwargs,
        )
        self._opt: Optimizer | DiLoCo | None = None
        self._num_peers = 1
        self._left = False  # the swarm is left (teardown): num_peers stays as it was
        self._optimizer_zero_grad_original: Callable[..., None] | None = None
        self._initialized = False
        env = os.environ.get(self.INITIAL_PEERS_ENV)
        peers = env if env is not None else initial_peers
        self._initial_peers: list[str] | None = (
            [p.strip() for p in peers.split(",") if p.strip()]
            if isinstance(peers, str)
            else (list(peers) if peers is not None else None)
        )
        self._own_node = node is None
        self._membership: Membership | None = None
        self._data_dir_lock: DataDirLock | None = None  # the key's directory, held while joined
        self._reports: OptimizerReports | None = None
        self._samples = 0
        self._reported_at = 0.0
        self._samples_at_report = 0
        if coordinator is not None or token is not None:
            if not (coordinator and token):
                raise ValueError("joining a coordinator's run needs both coordinator= and token=")
            if node is not None or self._initial_peers:
                raise ValueError(
                    "coordinator= finds the run's peers itself: pass no node or initial_peers"
                )
            node = self._join(coordinator, token, name, data_dir, host, port)
        elif node is None:
            from peer.formats.identity import OpenAuth
            from peer.node import Node

            # explicit peers and no coordinator: an open swarm, as Lightning's own strategy
            node = Node(self._initial_peers, host=host, port=port, auth=OpenAuth())
            log.warning(
                "this swarm is open: anyone who can reach %s may join it (join a "
                "coordinator's run with coordinator= and token= for authenticated peers)",
                ",".join(node.visible_addresses),
            )
        self.node = node
        addresses = ",".join(node.visible_addresses)
        if self._membership is not None:
            log.info(
                "joined run %s of %s (%s); others join with their own invite token",
                self._run_id,
                coordinator,
                self._membership.reachability,
            )
        elif not self._initial_peers and addresses:
            log.info(
                "Other machines join this run with: %s=%s python <your script>  "
                "(or SwarmgradStrategy(initial_peers=%r))",
                self.INITIAL_PEERS_ENV,
                addresses,
                addresses,
            )

    def _join(
        self,
        url: str,
        token: str,
        name: str | None,
        data_dir: str | os.PathLike[str] | None,
        host: str,
        port: int,
    ) -> Node:
        """Join a coordinator's run as ``swarmgrad join`` does; progress goes to it."""
        from pathlib import Path

        from peer.coordinator import CoordinatorClient
        from peer.coordinator.joining import NodeOptions, join_run
        from peer.coordinator.reports import OptimizerReports
        from peer.data_dir import default_data_dir, load_identity, lock_data_dir

        directory = Path(data_dir) if data_dir is not None else default_data_dir()
        # one process per key, as for ``swarmgrad join``: held until teardown
        lock = lock_data_dir(directory)
        identity = load_identity(directory)
        client = CoordinatorClient(url)
        try:
            membership = join_run(
                client, token, identity, node_options=NodeOptions(host, port), display_name=name
            )
        except BaseException:
            client.close()
            lock.release()
            raise
        self._data_dir_lock = lock
        self._membership = membership
        self._reports = OptimizerReports()
        self._run_id = membership.answer.run_id
        self._own_node = True
        return membership.node

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], object],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: object,
    ) -> object:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._samples += int(self._batch_size or 0)
        if self._membership is not None and self._opt is not None:
            self._report(result)
        return result

    def _report(self, loss: object, force: bool = False) -> None:
        """A progress report to the coordinator, at most every REPORT_INTERVAL_S (never blocks)."""
        now = time.monotonic()
        if not force and now - self._reported_at < REPORT_INTERVAL_S:
            return
        elapsed = now - self._reported_at if self._reported_at else 0.0
        rate = (self._samples - self._samples_at_report) / elapsed if elapsed > 0 else 0.0
        value = float(loss) if isinstance(loss, (int, float, torch.Tensor)) else None
        assert self._membership is not None and self._reports is not None  # set by _join
        assert self._opt is not None  # both callers check it
        self._membership.session.submit_report(
            self._reports.fields(
                self._opt, samples=self._samples, samples_per_second=rate, loss=value
            )
        )
        self._reported_at = now
        self._samples_at_report = self._samples

    # ------------------------------------------------------------- Lightning's API

    @property
    def root_device(self) -> torch.device:
        name = type(self.accelerator).__name__
        if name == "CUDAAccelerator":
            return torch.device(f"cuda:{torch.cuda.current_device()}")
        if name == "CPUAccelerator" or self.accelerator is None:
            return torch.device("cpu")
        raise self.lightning_package.misconfiguration(
            f"SwarmgradStrategy cannot use the accelerator {type(self.accelerator).__name__}"
        )

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return True

    @property
    def num_peers(self) -> int:
        """Peers reporting at the swarm's epoch (1 before training starts; after it ends,
        the number when it ended, as hivemind's: the swarm is not asked again)."""
        if self._opt is not None and not self._left:
            try:
                self._num_peers = max(1, int(self._opt.global_progress.num_peers))
            except NodeShutdown:
                pass  # the swarm is left: the last number seen
        return self._num_peers

    @property
    def optimizer(self) -> Optimizer | DiLoCo | None:
        """The collaborative :class:`~peer.Optimizer` (``None`` before the first batch)."""
        return self._opt

    def setup(self, trainer: pl.Trainer) -> None:
        self.model_to_device()
        super().setup(trainer)
        if "16" in str(self.precision_plugin.precision) and "bf16" not in str(
            self.precision_plugin.precision
        ):
            raise self.lightning_package.misconfiguration(
                "SwarmgradStrategy supports precision '32-true' and 'bf16-mixed': float16 needs "
                "a loss scaler, which Lightning would step outside the swarm's optimizer"
            )

    def on_train_batch_start(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._initialized:
            return
        self._initialized = True
        if self._batch_size is None:
            try:
                self._batch_size = self.lightning_package.extract_batch_size(batch)
            except (self.lightning_package.misconfiguration, RecursionError) as exc:
                raise self.lightning_package.misconfiguration(
                    "Could not infer the batch size from the first batch. Please provide the "
                    "batch size to the Strategy: Trainer(strategy=SwarmgradStrategy(batch_size=x))"
                ) from exc
            log.info("batch size per step, from the first batch: %d", self._batch_size)
        self._initialize_swarm()

    def _initialize_swarm(self) -> None:
        from peer.optim.collaborative.optimizer import Optimizer

        if len(self.optimizers) != 1:
            raise self.lightning_package.misconfiguration(
                "SwarmgradStrategy supports exactly one optimizer."
            )
        optimizer = self.optimizers[0]
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if self._require_scheduler_fn and self._scheduler_fn is None:
            self.lightning_package.rank_zero_warn(
                "Enabling `delay_optimizer_step`, `delay_state_averaging` or `offload_optimizer` "
                "requires a `scheduler_fn` to be passed to the strategy if a scheduler is being "
                "used (the optimizer is re-created in the swarm's optimizer)."
            )
        if self._algorithm == "diloco":
            self._initialize_diloco(optimizer)
            return
        if self._require_scheduler_fn:
            groups = optimizer.param_groups
            opt_arg: Any = type(optimizer)
            params: Any = groups
        else:
            opt_arg, params = optimizer, None
        assert self._target_batch_size is not None  # checked in __init__
        opt = Optimizer(
            node=self.node,
            run_id=self._run_id,
            params=params,
            optimizer=opt_arg,
            scheduler=self._scheduler_fn if self._require_scheduler_fn else None,
            target_batch_size=self._target_batch_size,
            batch_size_per_step=self._batch_size,
            **self._optimizer_kwargs,
        )
        if not self._scheduler_fn:
            self._wrap_schedulers(opt)
        self.optimizers = [opt]  # type: ignore[list-item]  # it has step/zero_grad/state
        self._opt = opt
        if self._reuse_grad_buffers:
            module = self.lightning_module
            assert module is not None
            if self.lightning_package.is_overridden("optimizer_zero_grad", module):
                self.lightning_package.rank_zero_warn(
                    "You have overridden `optimizer_zero_grad` which will be disabled. With "
                    "`SwarmgradStrategy(reuse_grad_buffers=True)` the optimizer cannot zero the "
                    "gradients: they accumulate in place until the swarm's step."
                )
            self._optimizer_zero_grad_original = module.optimizer_zero_grad
            module.optimizer_zero_grad = _no_zero_grad  # type: ignore[method-assign]

    def _initialize_diloco(self, optimizer: torch.optim.Optimizer) -> None:
        """``algorithm="diloco"``: the module's own optimizer takes the inner steps (its
        schedulers step it as usual, per inner step); ``inner_steps``, ``fragments``,
        ``compression``, ``overlap``, ``outer_optimizer``, ... come from the strategy's
        other keyword arguments."""
        from peer.optim.diloco.outer import DiLoCo

        kwargs = {
            k: v
            for k, v in self._optimizer_kwargs.items()
            if k
            not in (
                "delay_optimizer_step",
                "delay_state_averaging",
                "delay_grad_averaging",
                "offload_optimizer",
                "reuse_grad_buffers",
            )
        }
        kwargs.setdefault("inner_steps", 100)
        opt = DiLoCo(
            node=self.node,
            run_id=self._run_id,
            params=[p for group in optimizer.param_groups for p in group["params"]],
            inner_optimizer=lambda params: optimizer,
            batch_size_per_step=self._batch_size,
            **kwargs,
        )
        self.optimizers = [opt]  # type: ignore[list-item]  # it has step/zero_grad/state
        self._opt = opt

    def _wrap_schedulers(self, opt: Optimizer) -> None:
        for config in self.lr_scheduler_configs:
            if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    f"The `ReduceLROnPlateau` scheduler is not supported with `{type(self).__name__}`."
                )
            config.scheduler = SwarmScheduler(opt, config.scheduler)  # type: ignore[assignment]

    def reduce(self, tensor: T, *args: object, **kwargs: object) -> T:
        return tensor

    def all_gather(
        self, tensor: torch.Tensor, group: object = None, sync_grads: bool = False
    ) -> torch.Tensor:
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, *args: object, **kwargs: object) -> None:
        pass

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def teardown(self) -> None:
        module = self.lightning_module
        if self._optimizer_zero_grad_original is not None and module is not None:
            module.optimizer_zero_grad = self._optimizer_zero_grad_original  # type: ignore[method-assign]
            self._optimizer_zero_grad_original = None
        if self._opt is not None:
            if self._membership is not None:
                self._report(None, force=True)
            _ = self.num_peers  # kept for after the swarm is left
            self._left = True
            self._opt.shutdown()
            if self._algorithm == "diloco":
                from peer.optim.diloco.outer import DiLoCo

                assert isinstance(self._opt, DiLoCo)  # _initialize_diloco made it
                # Lightning moves the optimizers' state back at teardown: the inner one's
                self.optimizers = [self._opt.inner_optimizer]
        if self._membership is not None:
            self._membership.close()  # flushes the reports
            if self._data_dir_lock is not None:
                self._data_dir_lock.release()
                self._data_dir_lock = None
        elif self._own_node:
            log.info("leaving the swarm")
            self.node.shutdown()
        super().teardown()


def _no_zero_grad(*args: object, **kwargs: object) -> None:
    """Stands in for ``optimizer_zero_grad`` with ``reuse_grad_buffers``."""


class SwarmScheduler:
    """A scheduler that steps on swarm epochs: Lightning calls :meth:`step` as usual; the
    wrapped scheduler catches up to the swarm's epoch."""

    def __init__(self, optimizer: Optimizer, scheduler: LRScheduler) -> None:
        self.__dict__ = {
            k: v for k, v in scheduler.__dict__.items() if k not in ("step", "__del__")
        }
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.current_step = 0  # swarm epochs the scheduler has stepped for

    def step(self, epoch: int | None = None) -> None:
        while self.current_step < self.optimizer.local_epoch:
            self.scheduler.step()
            self.current_step += 1

    def state_dict(self) -> StateDict:
        return {"current_step": self.current_step, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: StateDict) -> None:
        self.current_step = state["current_step"]
        self.scheduler.load_state_dict(state["scheduler"])
