"""DASO without a network: the schedule step by step against scripted losses, what a batch
does, how a received average is merged, and the original's argument checks."""

from __future__ import annotations

import pytest
import torch

from peer.optim.hierarchy.daso import DASO, DataParallelOptimizer
from peer.optim.hierarchy.daso_schedule import BatchPlan, LocalSync, Phase, SkipSchedule, plan_batch


def test_schedule_follows_the_documented_phases() -> None:
    """Warm-up, cycling (decay by the reduction factor when the loss is stable for more than
    two epochs, reset once global_skip is 1), cool-down."""
    schedule = SkipSchedule(total_epochs=16, warmup_epochs=2, cooldown_epochs=2)
    losses = {1: 2.0, 2: 1.0, 3: 0.99, 4: 0.99, 5: 0.99, 6: 0.5, 7: 0.5, 8: 0.5, 9: 0.5}
    losses |= {10: 0.49, 11: 0.49, 12: 0.49, 13: 0.49, 14: 0.3, 15: 0.3}
    expected = {
        1: (Phase.WARMUP, (0, 0, 0)),
        2: (Phase.CYCLING, (4, 1, 1)),  # the cycling phase starts
        3: (Phase.CYCLING, (4, 1, 1)),  # not improving by 5 %: one bad epoch
        4: (Phase.CYCLING, (4, 1, 1)),  # two
        5: (Phase.CYCLING, (2, 1, 1)),  # three: stable, skips halved (kept at least 1)
        6: (Phase.CYCLING, (2, 1, 1)),  # improving again
        7: (Phase.CYCLING, (2, 1, 1)),
        8: (Phase.CYCLING, (2, 1, 1)),
        9: (Phase.CYCLING, (1, 1, 1)),  # stable: halved again
        10: (Phase.CYCLING, (1, 1, 1)),  # 0.49 is not 5 % better than 0.5
        11: (Phase.CYCLING, (1, 1, 1)),
        12: (Phase.CYCLING, (8, 2, 2)),  # stable at 1: reset to max_global_skips
        13: (Phase.CYCLING, (8, 2, 2)),
        14: (Phase.COOLDOWN, (0, 0, 0)),
        15: (Phase.COOLDOWN, (0, 0, 0)),
    }
    for epoch, (phase, skips) in expected.items():
        assert schedule.after_epoch(epoch, losses[epoch]) is phase, epoch
        assert (schedule.global_skip, schedule.local_skip, schedule.batches_to_wait) == skips, epoch


def test_schedule_with_a_larger_reduction_factor_and_local_skips() -> None:
    schedule = SkipSchedule(
        total_epochs=20,
        warmup_epochs=0,
        cooldown_epochs=0,
        max_global_skips=16,
        skip_reduction_factor=4,
        local_skip_factor=2,
    )
    schedule.after_epoch(0, 1.0)
    assert (schedule.global_skip, schedule.local_skip, schedule.batches_to_wait) == (4, 1, 1)
    for epoch in (1, 2, 3):
        schedule.after_epoch(epoch, 1.0)
    assert (schedule.global_skip, schedule.local_skip, schedule.batches_to_wait) == (1, 1, 1)
    for epoch in (4, 5, 6):
        schedule.after_epoch(epoch, 1.0)
    assert (schedule.global_skip, schedule.local_skip, schedule.batches_to_wait) == (16, 8, 8)


def test_batch_plans_of_an_epoch() -> None:
    plans = [plan_batch(b, 9, 4, 1, 1) for b in range(10)]
    assert plans[0] == BatchPlan(global_sync=True, batches_to_wait=1)
    assert plans[1] == BatchPlan(receive=True, local=LocalSync.START)
    assert plans[2] == BatchPlan(local=LocalSync.START)
    assert plans[3] == BatchPlan(local=LocalSync.START)  # the next batch syncs globally
    assert plans[4] == BatchPlan(global_sync=True, batches_to_wait=1)
    assert plans[8] == BatchPlan(global_sync=True, batches_to_wait=1)
    assert plans[9] == BatchPlan(global_sync=True, batches_to_wait=0)  # last: blocking
    # warm-up / cool-down: every batch blocks
    assert all(plan_batch(b, 5, 0, 0, 0) == BatchPlan(True, 0) for b in range(6))
    # local skips of 2: local sync alternates between the sync points
    plans = [plan_batch(b, 15, 8, 2, 2) for b in range(16)]
    assert plans[1] == BatchPlan()  # waiting for the global average
    assert plans[2] == BatchPlan(receive=True, local=LocalSync.STOP)
    assert plans[3] == BatchPlan(local=LocalSync.START)
    assert plans[4] == BatchPlan(local=LocalSync.STOP)
    assert plans[7] == BatchPlan(local=LocalSync.START)
    # a receive never lands after the epoch's end
    assert plan_batch(8, 9, 8, 2, 2) == BatchPlan(global_sync=True, batches_to_wait=1)


class _Control(int):
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _FakeGlobal:
    """Stands in for the swarm level: every round's group holds this peer and one whose
    parameters are ``other``."""

    def __init__(self, other: float) -> None:
        self.other = other
        self.sent: list[torch.Tensor] = []
        self.buffer: torch.Tensor | None = None

    def begin(self, values: torch.Tensor) -> _Control:
        self.sent.append(values.clone())
        self.buffer = values.clone()
        return _Control(len(self.sent) - 1)

    def finish(self, control: int, out: torch.Tensor) -> int:
        out.copy_((self.sent[control].float() + self.other) / 2)
        return 2

    def shutdown(self) -> None:
        pass


def _daso(**kwargs) -> tuple[DASO, torch.nn.Parameter, _FakeGlobal]:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    daso = DASO(opt, total_epochs=4, warmup_epochs=1, cooldown_epochs=1, **kwargs)
    fake = _FakeGlobal(other=10.0)
    daso._global = fake  # type: ignore[assignment]
    daso.last_batch = 3
    return daso, p, fake


def _batch(daso: DASO, p: torch.nn.Parameter, grad: float = -1.0) -> None:
    daso.zero_grad()
    p.grad = torch.full_like(p, grad)  # each step adds 1 to the parameters
    daso.step()


def test_warm_up_replaces_the_parameters_with_the_average_after_every_batch() -> None:
    daso, p, fake = _daso()
    _batch(daso, p)
    assert len(fake.sent) == 1 and fake.sent[0].dtype == torch.bfloat16
    assert p.tolist() == [5.5] * 3  # (1 + 10) / 2
    for _ in range(3):
        _batch(daso, p)
    assert daso.epoch == 1 and daso.current_batch == 0 and len(fake.sent) == 4


def test_cycling_merges_the_average_a_batch_later_as_the_original() -> None:
    daso, p, fake = _daso()
    daso.epoch = 1
    daso.epoch_loss_logic(1.0, loss_globally_averaged=True)
    assert (daso.global_skip, daso.local_skip, daso.batches_to_wait) == (4, 1, 1)
    _batch(daso, p)  # batch 0: sends 1.0, keeps training
    assert p.tolist() == [1.0] * 3 and len(fake.sent) == 1
    _batch(daso, p)  # batch 1: local 2.0, average (1 + 10) / 2 waited 1 batch
    numer, n = 2.0, 2
    assert p.tolist() == pytest.approx([(numer * 2.0 + n * 5.5) / (n + numer)] * 3)
    before = p[0].item()
    _batch(daso, p)  # batch 2: local only
    assert p[0].item() == pytest.approx(before + 1) and len(fake.sent) == 1
    _batch(daso, p)  # batch 3, the last: blocking, replaced
    assert len(fake.sent) == 2
    assert p.tolist() == pytest.approx([(before + 2 + 10) / 2] * 3, abs=0.05)  # bf16 sent
    assert daso.epoch == 2 and daso.current_batch == 0
    assert daso.global_rounds_done == 2


def test_non_finite_parameters_are_not_sent() -> None:
    daso, p, _ = _daso()
    with torch.no_grad():
        p[1] = float("nan")
    daso.zero_grad()
    p.grad = torch.zeros(3)
    with pytest.raises(ValueError, match="non-finite"):
        daso.step()


def test_step_needs_last_batch() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    daso = DASO(torch.optim.SGD([p], lr=0.1), total_epochs=2)
    p.grad = torch.zeros(1)
    with pytest.raises(ValueError, match="last_batch must be set"):
        daso.step()


def test_reset_returns_to_warm_up() -> None:
    daso, p, _ = _daso()
    daso.epoch = 1
    daso.epoch_loss_logic(1.0, loss_globally_averaged=True)
    _batch(daso, p)
    pending = daso._pending[0]
    daso.reset()
    assert pending.cancelled
    assert (daso.epoch, daso.current_batch, daso.global_skip, daso._pending) == (0, 0, 0, None)
    assert p.grad is not None and not p.grad.any()


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"local_optimizer": object()}, TypeError, "Local optimizer must be a torch optimizer"),
        ({"total_epochs": 2.0}, TypeError, "total_epochs must be an int"),
        ({"comm": "world"}, TypeError, "comm must be a torch.distributed ProcessGroup"),
        ({"warmup_epochs": "4"}, TypeError, "warmup_epochs must be an int"),
        ({"cooldown_epochs": None}, TypeError, "cooldown_epochs must be an int"),
        ({"scheduler": 3}, TypeError, "scheduler must be a torch learning rate scheduler"),
        ({"stability_level": 1}, TypeError, "stability_level must be a float"),
        ({"max_global_skips": 8.0}, TypeError, "max_global_skips must be an int"),
        ({"sending_chunk_size": "big"}, TypeError, "sending_chunk_size must be an int"),
        ({"verbose": 1}, TypeError, "verbose must be a bool"),
        ({"use_mpi_groups": 1}, TypeError, "use_mpi_groups must be a bool"),
        ({"downcast_type": "bf16"}, TypeError, "downcast_type must be a torch.dtype"),
        ({"downcast_type": torch.int8}, ValueError, "downcast_type must be one of"),
        ({"skip_reduction_factor": 2.0}, TypeError, "skip_reduction_factor must be an int"),
        ({"local_skip_factor": True}, TypeError, "local_skip_factor must be an int"),
        ({"warmup_epochs": -1}, ValueError, "warmup_epochs must be >= 0"),
        ({"cooldown_epochs": -1}, ValueError, "cooldown_epochs must be >= 0"),
        ({"max_global_skips": -1}, ValueError, "max_global_skips must be >= 0"),
        ({"sending_chunk_size": 0}, ValueError, "sending_chunk_size must be > 0"),
        ({"total_epochs": 0}, ValueError, "total_epochs must be > 0"),
        ({"skip_reduction_factor": 0}, ValueError, "skip_reduction_factor must be > 0"),
        ({"local_skip_factor": 0}, ValueError, "local_skip_factor must be > 0"),
    ],
)
def test_argument_checks(kwargs, error, message) -> None:
    args = {"local_optimizer": _opt(), "total_epochs": 10} | kwargs
    with pytest.raises(error, match=message):
        DASO(**args)


def test_data_parallel_optimizer_blocking_steps_at_once() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DataParallelOptimizer(torch.optim.SGD([p], lr=1.0), blocking=True)
    p.grad = torch.ones(2)
    opt.step()
    assert p.tolist() == [-1.0, -1.0]
    with pytest.raises(TypeError, match="blocking parameter must be a boolean"):
        DataParallelOptimizer(torch.optim.SGD([p], lr=1.0), blocking=1)  # type: ignore[arg-type]


def test_data_parallel_optimizer_non_blocking_steps_at_the_next_forward() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    opt.set_model(model)
    model(torch.ones(1, 2)).sum().backward()  # grad = [1, 1]
    opt.step()
    assert opt.update_next and model.weight.tolist() == [[0.0, 0.0]]
    opt.zero_grad()
    out = model(torch.ones(1, 2))  # the update lands before this pass
    assert model.weight.tolist() == [[-1.0, -1.0]] and out.item() == -2.0
    assert not opt.update_next and not model.weight.grad.any()
