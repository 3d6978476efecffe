"""Repair what reports past today's bounds left behind: averaging-round counts, losses,
held-out metrics and group sizes no peer can produce, and epoch sums that overflowed
(SQLite stored them as floats; summing them then failed, which took the pages down).

Per raw report: rounds past 10^6 count as none, a loss or metric past ±10^6 and a group
past 4096 as unknown. Per epoch summary whose rounds or losses are out of reach of its
reports: recounted from its raw reports (those already folded by retention are gone, so
such an epoch counts what is left). Per peer and per snapshot: out-of-range values become
unknown, and a snapshot's rounds at most the run's repaired total. Data only: the schema is
unchanged, and the downgrade keeps the repaired values.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 23:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Literal here, not imported: a migration must do tomorrow what it does today.
MAX_INT = 2**53
MAX_ROUNDS_PER_REPORT = 10**6
MAX_ABS = 1e6
MAX_GROUP = 4096


def _out(column: str) -> str:
    return f"(ABS({column}) > {MAX_ABS:.0f})"


def upgrade() -> None:
    execute = op.execute
    for name in ("rounds_done", "rounds_failed"):
        execute(f"UPDATE progress_reports SET {name} = 0 WHERE {name} > {MAX_ROUNDS_PER_REPORT}")
    for table in ("progress_reports", "peers", "progress_snapshots"):
        execute(f"UPDATE {table} SET loss = NULL WHERE {_out('loss')}")
        execute(f"UPDATE {table} SET eval_metric = NULL WHERE {_out('eval_metric')}")
    execute(f"UPDATE progress_reports SET group_size = NULL WHERE group_size > {MAX_GROUP}")
    execute(f"UPDATE peers SET group_size = NULL WHERE group_size > {MAX_GROUP}")
    execute(
        f"UPDATE progress_snapshots SET mean_group_size = NULL WHERE mean_group_size > {MAX_GROUP}"
    )

    same_epoch = "r.run_id = epoch_summaries.run_id AND r.epoch = epoch_summaries.epoch"
    for name in ("rounds_done", "rounds_failed"):
        execute(
            f"UPDATE epoch_summaries SET {name} = (SELECT COALESCE(SUM(r.{name}), 0) "
            f"FROM progress_reports r WHERE {same_epoch}) "
            f"WHERE {name} > reports * {MAX_ROUNDS_PER_REPORT} OR {name} > {MAX_INT}"
        )
    execute(
        "UPDATE epoch_summaries SET "
        f"loss_sum = (SELECT COALESCE(SUM(r.loss), 0) FROM progress_reports r WHERE {same_epoch}), "
        f"loss_count = (SELECT COUNT(r.loss) FROM progress_reports r WHERE {same_epoch}) "
        f"WHERE ABS(loss_sum) > loss_count * {MAX_ABS:.0f}"
    )
    execute(
        "UPDATE epoch_summaries SET max_group_size = "
        f"(SELECT MAX(r.group_size) FROM progress_reports r WHERE {same_epoch}) "
        f"WHERE max_group_size > {MAX_GROUP}"
    )
    for name in ("rounds_done", "rounds_failed"):
        total = f"(SELECT COALESCE(SUM(e.{name}), 0) FROM epoch_summaries e WHERE e.run_id = progress_snapshots.run_id)"
        execute(f"UPDATE progress_snapshots SET {name} = {total} WHERE {name} > {total}")


def downgrade() -> None:
    """Nothing to undo: the values repaired were never plausible."""
