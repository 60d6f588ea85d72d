"""Text renderings of a task table. Pure.

``render_table`` prints what InfiniTrain logs: per rank, one row per action with the columns
step, type, microbatch, global chunk, local chunk, stage. In pipetrain's vocabulary a chunk's global
index *is* its stage, so "global chunk" and "stage" hold the same number; both columns are kept
so that logs line up with InfiniTrain's. ``render_grid`` draws the lock-step timeline: one row per
rank, one column per step, ``.`` where the rank waits.
"""

from __future__ import annotations

from pipetrain.pipeline.check import lockstep
from pipetrain.pipeline.schedules import ScheduleTable

_COLUMNS = ("step", "type", "microbatch", "global chunk", "local chunk", "stage")


def render_header(table: ScheduleTable) -> str:
    """One line: schedule name and sizes."""
    return (
        f"schedule={table.name} pp={table.pp} vpp={table.vpp} "
        f"num_microbatches={table.num_microbatches} stages={table.num_stages}"
    )


def render_table(table: ScheduleTable) -> str:
    """Every rank's actions as rows of the InfiniTrain columns (see module docstring)."""
    widths = [max(len(c), 6) for c in _COLUMNS]
    lines = [render_header(table)]
    for rank, acts in sorted(table.actions.items()):
        stages = sorted({a.stage for a in acts})
        lines.append(f"rank {rank} (stages {', '.join(map(str, stages))})")
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths, strict=True)))
        for step, a in enumerate(acts):
            row = (step, a.kind, a.microbatch, a.stage, table.local_chunk(a.stage), a.stage)
            lines.append("  " + "  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def render_grid(table: ScheduleTable) -> str:
    """The lock-step timeline: ranks as rows, steps as columns, actions like ``2F0``.

    Raises:
        ScheduleError: the table cannot run (see ``check``).
    """
    timeline = lockstep(table)
    n_steps = 1 + max((t for tl in timeline.values() for t, _ in tl), default=-1)
    cells = {r: ["."] * n_steps for r in timeline}
    for r, tl in timeline.items():
        for t, a in tl:
            cells[r][t] = str(a)
    width = max((len(c) for row in cells.values() for c in row), default=1)
    lines = [render_header(table) + f" lockstep_steps={n_steps}"]
    for r in sorted(cells):
        lines.append(f"rank {r}: " + " ".join(c.rjust(width) for c in cells[r]))
    return "\n".join(lines)
