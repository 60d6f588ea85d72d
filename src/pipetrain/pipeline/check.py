"""Validate a task table before any process group exists. Pure.

:func:`check` proves three things about a :class:`ScheduleTable`:

1. completeness: every stage has exactly one F and one B per microbatch, on the rank that the
   placement gives it, and nothing else;
2. order: on one rank, an action never comes before a local action it depends on (B before its F,
   F of stage s+1 before F of stage s when both are local);
3. channel order: between any two ranks, in each direction, messages are received in the order
   they are sent. Tags make gloo match a receive to its own message, but NCCL matches
   point-to-point operations by order alone, so the same table must be right without tags;
4. progress: when every rank runs its list in order, sending without blocking and blocking on
   each receive (exactly what the executor does), all ranks finish: no cross-rank deadlock.

(4) is decided by running the table in lock step: at each step every rank whose next action has
its inputs runs it; a message sent at step t can be received at step t + 1. If at some step no
rank can move, the table deadlocks, and the error names each blocked rank, its step and action.
"""

from __future__ import annotations

from collections import Counter

from pipetrain.pipeline.schedules import BACKWARD, FORWARD, KINDS, Action, ScheduleTable


class ScheduleError(ValueError):
    """A task table that cannot run. ``rank``, ``step`` and ``action`` locate the first problem."""

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None, action=None):
        where = ""
        if rank is not None:
            where = f"rank {rank}" + (f", step {step}" if step is not None else "")
            where += f", action {action}" if action is not None else ""
            where += ": "
        super().__init__(where + message)
        self.rank, self.step, self.action = rank, step, action


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """Actions that must have run before ``action``: its input's producer and, for B, its F."""
    s, mb = action.stage, action.microbatch
    if action.kind == FORWARD:
        return (Action(s - 1, FORWARD, mb),) if s > 0 else ()
    deps = [Action(s, FORWARD, mb)]
    if s < num_stages - 1:
        deps.append(Action(s + 1, BACKWARD, mb))
    return tuple(deps)


def _check_complete(table: ScheduleTable) -> None:
    n, m = table.num_stages, table.num_microbatches
    if sorted(table.actions) != list(range(table.pp)):
        raise ScheduleError(f"the table must list ranks 0..{table.pp - 1}, got {sorted(table.actions)}")
    seen: Counter[Action] = Counter()
    for rank, acts in table.actions.items():
        for step, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.stage < n or not 0 <= a.microbatch < m:
                raise ScheduleError(
                    f"action out of range (kinds {KINDS}, stages 0..{n - 1}, microbatches 0..{m - 1})",
                    rank=rank,
                    step=step,
                    action=a,
                )
            if table.placement[a.stage] != rank:
                raise ScheduleError(
                    f"stage {a.stage} is placed on rank {table.placement[a.stage]}, not here",
                    rank=rank,
                    step=step,
                    action=a,
                )
            seen[a] += 1
            if seen[a] > 1:
                raise ScheduleError("duplicate action", rank=rank, step=step, action=a)
    for s in range(n):
        for kind in KINDS:
            for mb in range(m):
                if Action(s, kind, mb) not in seen:
                    raise ScheduleError(
                        f"missing action {Action(s, kind, mb)}: stage {s} needs one {kind} per microbatch",
                        rank=table.placement[s],
                    )


def lockstep(table: ScheduleTable) -> dict[int, list[tuple[int, Action]]]:
    """Run the table in lock step; return each rank's (step, action) pairs.

    Raises:
        ScheduleError: an out-of-order local dependency or a cross-rank deadlock.
    """
    n = table.num_stages
    done: dict[Action, int] = {}
    ptr = dict.fromkeys(table.actions, 0)
    timeline: dict[int, list[tuple[int, Action]]] = {r: [] for r in table.actions}
    remaining = sum(len(a) for a in table.actions.values())
    t = 0
    while remaining:
        ready, blocked = [], []
        for rank, acts in table.actions.items():
            if ptr[rank] == len(acts):
                continue
            a = acts[ptr[rank]]
            waiting = []
            for dep in dependencies(a, n):
                if table.placement[dep.stage] == rank:
                    if dep not in done:
                        raise ScheduleError(
                            f"runs before {dep}, which this rank runs later",
                            rank=rank,
                            step=ptr[rank],
                            action=a,
                        )
                elif done.get(dep, t) >= t:
                    waiting.append(dep)
            (blocked if waiting else ready).append((rank, a, waiting))
        if not ready:
            detail = "; ".join(
                f"rank {r} step {ptr[r]} {a} waits for {', '.join(map(str, w))} (rank {table.placement[w[0].stage]})"
                for r, a, w in blocked
            )
            r0, a0, _ = blocked[0]
            raise ScheduleError(f"deadlock at lock step {t}: {detail}", rank=r0, step=ptr[r0], action=a0)
        for rank, a, _ in ready:
            done[a] = t
            timeline[rank].append((t, a))
            ptr[rank] += 1
            remaining -= 1
        t += 1
    return timeline


def messages(table: ScheduleTable) -> dict[tuple[int, int], tuple[list, list]]:
    """Per directed rank pair (src, dst): (messages in src's send order, in dst's receive order).

    A message is ("activation", stage it leaves, microbatch) or ("gradient", stage, microbatch).
    """
    n = table.num_stages
    channels: dict[tuple[int, int], tuple[list, list]] = {}

    def note(src: int, dst: int, which: int, msg: tuple) -> None:
        if src != dst:
            channels.setdefault((src, dst), ([], []))[which].append(msg)

    for rank, acts in table.actions.items():
        for a in acts:
            s, mb = a.stage, a.microbatch
            if a.kind == FORWARD:
                if s > 0:
                    note(table.placement[s - 1], rank, 1, ("activation", s - 1, mb))
                if s < n - 1:
                    note(rank, table.placement[s + 1], 0, ("activation", s, mb))
            else:
                if s < n - 1:
                    note(table.placement[s + 1], rank, 1, ("gradient", s + 1, mb))
                if s > 0:
                    note(rank, table.placement[s - 1], 0, ("gradient", s, mb))
    return channels


def _check_channel_order(table: ScheduleTable) -> None:
    for (src, dst), (sent, received) in sorted(messages(table).items()):
        for i, (out, into) in enumerate(zip(sent, received, strict=True)):
            if out != into:
                raise ScheduleError(
                    f"rank {src} sends {out[0]} of stage {out[1]} microbatch {out[2]} as its message #{i} to "
                    f"rank {dst}, which receives {into[0]} of stage {into[1]} microbatch {into[2]} there; "
                    "NCCL matches messages by order, so receives must follow the send order",
                    rank=dst,
                )


def check(table: ScheduleTable) -> None:
    """Raise :class:`ScheduleError` unless ``table`` is complete, ordered, channel-ordered and
    deadlock-free (see the module docstring)."""
    _check_complete(table)
    lockstep(table)
    _check_channel_order(table)
