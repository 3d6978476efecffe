"""Which phases end a collaborative epoch, and where they run (``peer.optim.collaborative.epochs``)."""

from __future__ import annotations

import itertools

import pytest

from peer.optim.collaborative.epochs import Phase, plan_epoch
from peer.optim.collaborative.options import resolve_options

G, S, T = Phase.GRADIENTS, Phase.STEP, Phase.STATE


def _plan(*, epoch: int = 0, every: int = 1, auxiliary: bool = False, **options: object):
    base = {
        "offload_optimizer": None,
        "delay_grad_averaging": False,
        "delay_optimizer_step": None,
        "delay_state_averaging": None,
        "reuse_grad_buffers": False,
        "use_local_updates": False,
        "optimizer_is_factory": True,
    }
    resolved = resolve_options(**(base | options))  # type: ignore[arg-type]
    return plan_epoch(
        resolved,
        epoch=epoch,
        samples=30,
        swarm_samples=120,
        target_batch_size=100,
        average_state_every=every,
        auxiliary=auxiliary,
    )


@pytest.mark.parametrize(
    ("options", "inline", "background"),
    [
        ({}, (G, S, T), ()),
        ({"delay_state_averaging": True}, (G, S), (T,)),
        ({"delay_optimizer_step": True}, (G,), (S, T)),
        ({"delay_grad_averaging": True}, (), (G, S, T)),
        ({"use_local_updates": True}, (S, T), ()),
        ({"use_local_updates": True, "delay_state_averaging": True}, (S,), (T,)),
    ],
)
def test_the_first_delayed_phase_and_all_after_it_run_in_the_background(
    options: dict[str, object], inline: tuple[Phase, ...], background: tuple[Phase, ...]
) -> None:
    plan = _plan(**options)
    assert (plan.inline, plan.background) == (inline, background)
    assert plan.holds_announcement == any(p in (G, T) for p in background)


def test_state_rounds_every_few_epochs_and_never_on_an_auxiliary_gradient_peer() -> None:
    assert [T in _plan(epoch=e, every=3).phases for e in range(6)] == [
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    helper = _plan(auxiliary=True)
    assert helper.phases == (G, S) and not helper.optimizer_step
    assert T in _plan(auxiliary=True, use_local_updates=True).phases


def test_every_plan_keeps_the_phase_order_and_splits_it_once() -> None:
    order = [G, S, T]
    for grad, step, state, local in itertools.product([False, True], repeat=4):
        try:
            plan = _plan(
                delay_grad_averaging=grad,
                delay_optimizer_step=step or None,
                delay_state_averaging=state or None,
                use_local_updates=local,
            )
        except ValueError:
            continue  # a combination resolve_options refuses
        assert list(plan.phases) == [p for p in order if p in plan.phases]
        assert S in plan.phases


def test_share_is_this_peers_part_of_the_target() -> None:
    assert _plan().share == pytest.approx(100 * 30 / 120)
