"""Tasks shipped with their runs: the ``task_files`` table (a task file's bytes, by
SHA-256) and a run's ``task_sha256`` and ``task_requirements``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 13:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "task_files",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("filename", sa.String(length=200), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_task_files")),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("task_sha256", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("task_requirements", sa.JSON(), nullable=True))
        batch.create_foreign_key(
            batch.f("fk_runs_task_sha256_task_files"),
            "task_files",
            ["task_sha256"],
            ["sha256"],
            ondelete="RESTRICT",
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(batch.f("fk_runs_task_sha256_task_files"), type_="foreignkey")
        batch.drop_column("task_requirements")
        batch.drop_column("task_sha256")
    op.drop_table("task_files")
