"""The collaborative optimizer's options: defaults filled in, impossible combinations refused.

Pure (no torch, no I/O): :func:`resolve_options` turns what the user passed to
:class:`peer.Optimizer` into :class:`CollaborativeOptions`, or raises ``ValueError`` naming
why a combination cannot work.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CollaborativeOptions", "resolve_options"]


@dataclass(frozen=True)
class CollaborativeOptions:
    """How an :class:`Optimizer` runs its epochs, once defaults are resolved and checked."""

    offload_optimizer: bool
    delay_grad_averaging: bool
    delay_optimizer_step: bool
    delay_state_averaging: bool
    reuse_grad_buffers: bool
    use_local_updates: bool

    @property
    def delays_anything(self) -> bool:
        return self.delay_grad_averaging or self.delay_optimizer_step or self.delay_state_averaging


def resolve_options(
    *,
    offload_optimizer: bool | None,
    delay_grad_averaging: bool,
    delay_optimizer_step: bool | None,
    delay_state_averaging: bool | None,
    reuse_grad_buffers: bool,
    use_local_updates: bool,
    optimizer_is_factory: bool,
) -> CollaborativeOptions:
    """Fill in the defaults (as hivemind: ``delay_optimizer_step`` follows
    ``delay_grad_averaging``; ``offload_optimizer`` and ``delay_state_averaging`` follow
    ``delay_optimizer_step``) and refuse combinations that cannot work, naming the reason."""
    if use_local_updates and reuse_grad_buffers:
        raise ValueError(
            "use_local_updates steps on every call, so there is no gradient accumulation to reuse"
        )
    if use_local_updates and delay_grad_averaging:
        raise ValueError(
            "use_local_updates averages parameters, not gradients: there is no gradient round "
            "to delay (delay_grad_averaging)"
        )
    if use_local_updates and delay_optimizer_step:
        raise ValueError(
            "use_local_updates steps on every call with that call's gradients; "
            "delay_optimizer_step is not supported with it (delay_state_averaging overlaps "
            "the epoch's parameter averaging instead)"
        )
    if delay_optimizer_step is None:
        delay_optimizer_step = delay_grad_averaging
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError(
            "delay_grad_averaging needs delay_optimizer_step: the optimizer step waits for the "
            "background round's gradients, so it must run in the background too"
        )
    if reuse_grad_buffers and delay_grad_averaging:
        raise ValueError(
            "reuse_grad_buffers cannot be combined with delay_grad_averaging (hivemind refuses "
            "it too): a delayed round needs its own copy of the gradients, the very buffer "
            "reuse_grad_buffers exists to save"
        )
    if offload_optimizer is None:
        offload_optimizer = delay_optimizer_step
    if delay_optimizer_step and not offload_optimizer:
        raise ValueError(
            "delay_optimizer_step needs offload_optimizer: the background step must update "
            "host-memory copies of the parameters, not the ones forward and backward passes read"
        )
    if delay_state_averaging is None:
        delay_state_averaging = delay_optimizer_step
    if delay_optimizer_step and not delay_state_averaging:
        raise ValueError(
            "state averaging follows the optimizer step, so with delay_optimizer_step it runs "
            "in the background too: leave delay_state_averaging unset or True"
        )
    if offload_optimizer and not optimizer_is_factory:
        raise ValueError(
            "offload_optimizer builds the optimizer on host-memory copies of the parameters: "
            "pass optimizer= as a factory (e.g. functools.partial(torch.optim.Adam, lr=1e-3)) "
            "and params="
        )
    return CollaborativeOptions(
        offload_optimizer=bool(offload_optimizer),
        delay_grad_averaging=bool(delay_grad_averaging),
        delay_optimizer_step=bool(delay_optimizer_step),
        delay_state_averaging=bool(delay_state_averaging),
        reuse_grad_buffers=bool(reuse_grad_buffers),
        use_local_updates=bool(use_local_updates),
    )
