"""Validate a task table before any process group exists. Pure.

:func:`check` lowers a compute table (F, B, I, W) to per-rank actions with explicit
communication, the way the executor runs it: a ``RECV_F``/``RECV_B`` right before the action that
consumes a message from another rank, a ``SEND_F``/``SEND_B`` right after the action that produces
one (see :func:`lower`). A table that already lists SEND/RECV actions (torch.distributed.pipelining's
lowered CSV, or the output of :func:`lower`) is checked as written; the executor still runs
only its compute actions, with its own communication (sending as early and receiving as late as
the checked order, so it cannot deadlock where the written order does not). It then proves:

1. completeness: every stage has, for every microbatch, one F and either one B or one I and one W;
   a stage's actions are all on one rank, the one the placement gives it;
2. communication: a lowered table holds exactly the SEND/RECV actions its compute actions need;
3. order and progress: running every rank's list in lock step (sends never wait; a receive blocks
   until its message was sent at an earlier step; a rank runs at most one compute action per step),
   no action runs before an action it depends on (B or I before its F, W before its I, F before the
   F that produces its input when both are local) and all ranks finish: no cross-rank deadlock.

Channel order is not required: a rank may consume a peer's messages in another order than the
peer sends them (ZB-V and interleaved zero bubble do). NCCL pairs messages by order, not tag, so
the executor receives each peer's messages in send order (:func:`messages` gives it), holding any
that come early; that never waits longer than the on-demand receive this check simulates.

Every error is a :class:`ScheduleError` that names the rank, the step (index in that rank's list)
and the action.
"""

from __future__ import annotations

from collections import Counter

from pipetrain.pipeline.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMM_KINDS,
    COMPUTE_KINDS,
    FORWARD,
    KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ScheduleTable,
)

# Events an action makes available: a stage's output activation, the gradient of its input, its
# weight gradient. ("act", s, mb) leaves stage s for stage s + 1; ("dx", s, mb) leaves s for s - 1.
Event = tuple[str, int, int]
_EVENT_NAMES = {"act": "activation", "dx": "input gradient", "dw": "weight gradient"}


def _describe(event: Event) -> str:
    return f"{_EVENT_NAMES[event[0]]} of stage {event[1]} microbatch {event[2]}"


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


def produces(action: Action) -> tuple[Event, ...]:
    """Events a compute action makes available (see ``Event``)."""
    s, mb = action.stage, action.microbatch
    return {
        FORWARD: (("act", s, mb),),
        BACKWARD: (("dx", s, mb), ("dw", s, mb)),
        BACKWARD_INPUT: (("dx", s, mb),),
        BACKWARD_WEIGHT: (("dw", s, mb),),
    }[action.kind]


def requires(action: Action, num_stages: int) -> tuple[Event, ...]:
    """Events a compute action needs: its input, and for a backward its own F and the gradient of
    its output; a W needs its I (which implies the F)."""
    s, mb = action.stage, action.microbatch
    if action.kind == FORWARD:
        return (("act", s - 1, mb),) if s > 0 else ()
    if action.kind == BACKWARD_WEIGHT:
        return (("dx", s, mb),)
    deps: tuple[Event, ...] = (("act", s, mb),)
    return deps + ((("dx", s + 1, mb),) if s < num_stages - 1 else ())


def message_of(action: Action) -> Event:
    """The message a SEND/RECV action carries, as the event it transports."""
    s, mb = action.stage, action.microbatch
    return {SEND_F: ("act", s, mb), RECV_F: ("act", s - 1, mb), SEND_B: ("dx", s, mb), RECV_B: ("dx", s + 1, mb)}[
        action.kind
    ]


def _recv_for(event: Event) -> Action:
    kind, s, mb = event
    return Action(s + 1, RECV_F, mb) if kind == "act" else Action(s - 1, RECV_B, mb)


def _send_for(event: Event) -> Action:
    kind, s, mb = event
    return Action(s, SEND_F if kind == "act" else SEND_B, mb)


def _destination(event: Event, table: ScheduleTable) -> int | None:
    kind, s, _ = event
    if kind == "act":
        return table.placement[s + 1] if s + 1 < table.num_stages else None
    if kind == "dx":
        return table.placement[s - 1] if s > 0 else None
    return None


def lower(table: ScheduleTable) -> dict[int, tuple[Action, ...]]:
    """Each rank's compute actions with the SEND/RECV actions the executor performs around them.

    A RECV comes right before the compute action that consumes the message (the executor receives
    on demand), a SEND right after the action that produces it. Messages between two stages of
    the same rank stay local and get no action.
    """
    n = table.num_stages
    lowered = {}
    for rank in range(table.pp):
        out: list[Action] = []
        for a in table.compute_actions(rank):
            for event in requires(a, n):
                if event[1] != a.stage and table.placement[event[1]] != rank:
                    out.append(_recv_for(event))
            out.append(a)
            for event in produces(a):
                dst = _destination(event, table)
                if dst is not None and dst != rank:
                    out.append(_send_for(event))
        lowered[rank] = tuple(out)
    return lowered


def _check_complete(table: ScheduleTable) -> None:
    n, m = table.num_stages, table.num_microbatches
    if sorted(table.actions) != list(range(table.pp)):
        raise ScheduleError(f"the table must list ranks 0..{table.pp - 1}, got {sorted(table.actions)}")
    if len(table.placement) != n:
        raise ScheduleError(f"the placement gives {len(table.placement)} ranks for {n} stages")
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
                    f"stage {a.stage} is on rank {table.placement[a.stage]} and also on rank {rank}; "
                    "all actions of a stage run on the one rank that holds its layers",
                    rank=rank,
                    step=step,
                    action=a,
                )
            seen[a] += 1
            if seen[a] > 1:
                raise ScheduleError("duplicate action: it already appears earlier", rank=rank, step=step, action=a)
    for s in range(n):
        rank = table.placement[s]
        for mb in range(m):
            has = {kind for kind in COMPUTE_KINDS if Action(s, kind, mb) in seen}
            problem, action = None, None
            if FORWARD not in has:
                action = Action(s, FORWARD, mb)
                problem = f"missing: stage {s} needs one F per microbatch"
            elif BACKWARD in has and has & {BACKWARD_INPUT, BACKWARD_WEIGHT}:
                action = Action(s, BACKWARD, mb)
                problem = (
                    f"stage {s} microbatch {mb} has a full backward {action} and also I/W; use B, or I and W, not both"
                )
            elif BACKWARD_INPUT in has and BACKWARD_WEIGHT not in has:
                action = Action(s, BACKWARD_WEIGHT, mb)
                problem = f"missing: {Action(s, BACKWARD_INPUT, mb)} needs its W"
            elif BACKWARD_WEIGHT in has and BACKWARD_INPUT not in has:
                action = Action(s, BACKWARD_INPUT, mb)
                problem = f"missing: {Action(s, BACKWARD_WEIGHT, mb)} needs its I"
            elif not has & {BACKWARD, BACKWARD_INPUT}:
                action = Action(s, BACKWARD, mb)
                problem = (
                    f"missing backward of stage {s} microbatch {mb}: "
                    f"needs {Action(s, BACKWARD, mb)}, or {Action(s, BACKWARD_INPUT, mb)} and "
                    f"{Action(s, BACKWARD_WEIGHT, mb)}"
                )
            if problem:
                raise ScheduleError(problem, rank=rank, action=action)


def _lowered(table: ScheduleTable) -> dict[int, tuple[Action, ...]]:
    """The table's own SEND/RECV actions when it has any (checked against what it needs), else
    :func:`lower`'s."""
    if not any(a.kind in COMM_KINDS for acts in table.actions.values() for a in acts):
        return lower(table)
    needed = lower(table)
    for rank in range(table.pp):
        want = Counter(a for a in needed[rank] if a.kind in COMM_KINDS)
        for step, a in enumerate(table.actions[rank]):
            if a.kind not in COMM_KINDS:
                continue
            if want[a] == 0:
                raise ScheduleError(
                    f"communication action not needed by any compute action of this rank (the "
                    f"{_describe(message_of(a))} does not cross ranks here, or it is listed twice)",
                    rank=rank,
                    step=step,
                    action=a,
                )
            want[a] -= 1
        missing = sorted(a for a, k in want.items() if k > 0)
        if missing:
            raise ScheduleError(
                f"missing communication action {missing[0]}: the lowered table must send/receive every message "
                f"that crosses ranks ({len(missing)} missing on this rank)",
                rank=rank,
                action=missing[0],
            )
    return {r: tuple(table.actions[r]) for r in range(table.pp)}


def _producer_name(event: Event, table: ScheduleTable) -> str:
    kind, s, mb = event
    if kind == "act":
        return str(Action(s, FORWARD, mb))
    uses_split = any(a == Action(s, BACKWARD_INPUT, mb) for a in table.actions[table.placement[s]])
    return str(Action(s, BACKWARD_INPUT if uses_split else BACKWARD, mb))


def lockstep(table: ScheduleTable) -> dict[int, list[tuple[int, Action]]]:
    """Run the (lowered) table in lock step; return each rank's (step, compute action) pairs.

    Raises:
        ScheduleError: an action that runs before one it depends on, a send before its data
            exists, a compute action whose remote input was never received, or a deadlock.
    """
    n = table.num_stages
    seqs = _lowered(table)
    explicit = any(a.kind in COMM_KINDS for acts in table.actions.values() for a in acts)
    produced: set[Event] = set()
    posted: dict[Event, int] = {}
    received: dict[int, set[Event]] = {r: set() for r in seqs}
    ptr = dict.fromkeys(seqs, 0)
    computed = dict.fromkeys(seqs, 0)
    timeline: dict[int, list[tuple[int, Action]]] = {r: [] for r in seqs}
    remaining = sum(len(s) for s in seqs.values())
    t = 0

    def where(rank: int) -> tuple[int, Action]:
        """(step, action) to report: the table's own index, or the next compute action."""
        seq = seqs[rank]
        if explicit:
            return ptr[rank], seq[ptr[rank]]
        nxt = next((a for a in seq[ptr[rank] :] if a.is_compute), seq[ptr[rank]])
        return computed[rank], nxt

    while remaining:
        moved = False
        blocked: list[tuple[int, Action, Event]] = []
        for rank, seq in seqs.items():
            did_compute = False
            while ptr[rank] < len(seq):
                a = seq[ptr[rank]]
                if a.kind in (SEND_F, SEND_B):
                    msg = message_of(a)
                    if msg not in produced:
                        raise ScheduleError(
                            f"sends the {_describe(msg)} before {_producer_name(msg, table)} computes it",
                            rank=rank,
                            step=ptr[rank],
                            action=a,
                        )
                    posted[msg] = t
                elif a.kind in (RECV_F, RECV_B):
                    msg = message_of(a)
                    if posted.get(msg, t) >= t:
                        blocked.append((rank, a, msg))
                        break
                    received[rank].add(msg)
                else:
                    if did_compute:
                        break
                    for event in requires(a, n):
                        local = event[1] == a.stage or table.placement[event[1]] == rank
                        if local and event not in produced:
                            raise ScheduleError(
                                f"runs before {_producer_name(event, table)}, which it depends on and which "
                                "this rank runs later",
                                rank=rank,
                                step=where(rank)[0],
                                action=a,
                            )
                        if not local and event not in received[rank]:
                            raise ScheduleError(
                                f"needs the {_describe(event)} from rank "
                                f"{table.placement[event[1]]}, but no {_recv_for(event)} comes before it",
                                rank=rank,
                                step=where(rank)[0],
                                action=a,
                            )
                    produced.update(produces(a))
                    timeline[rank].append((t, a))
                    computed[rank] += 1
                    did_compute = True
                ptr[rank] += 1
                remaining -= 1
                moved = True
        if not moved:
            details, first = [], None
            for rank, _recv, msg in blocked:
                step, action = where(rank)
                first = first or (rank, step, action)
                src = table.placement[msg[1]]
                details.append(
                    f"rank {rank} step {step} {action} waits for the {_describe(msg)} "
                    f"from rank {src} ({_send_for(msg)} not yet sent)"
                )
            rank, step, action = first
            raise ScheduleError(
                f"deadlock at lock step {t}: " + "; ".join(details), rank=rank, step=step, action=action
            )
        t += 1
    return timeline


def messages(table: ScheduleTable) -> dict[tuple[int, int], tuple[list, list]]:
    """Per directed rank pair (src, dst): (messages in src's send order, in dst's receive order),
    as the executor sends and receives them (:func:`lower`).

    A message is ("activation", stage it leaves, microbatch) or ("gradient", stage, microbatch).
    """
    channels: dict[tuple[int, int], tuple[list, list]] = {}
    names = {"act": "activation", "dx": "gradient"}
    for rank, seq in lower(table).items():
        for a in seq:
            if a.kind not in COMM_KINDS:
                continue
            kind, s, mb = message_of(a)
            msg = (names[kind], s, mb)
            if a.kind in (SEND_F, SEND_B):
                dst = _destination((kind, s, mb), table)
                channels.setdefault((rank, dst), ([], []))[0].append(msg)
            else:
                channels.setdefault((table.placement[s], rank), ([], []))[1].append(msg)
    return channels


def check(table: ScheduleTable) -> None:
    """Raise :class:`ScheduleError` unless ``table`` is complete, correctly lowered, ordered and
    deadlock-free (see the module docstring)."""
    _check_complete(table)
    lockstep(table)
