"""Cost-model simulation of a task table. Pure.

Each rank runs its actions in order; an action starts when its rank is free and its inputs have
arrived (the producer's end time, plus ``comm`` when the producer is on another rank). With unit
costs F=1, B=2 and comm=0 the makespan reproduces the closed-form bubbles:
(pp-1)/(m+pp-1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021) and
(pp-1)/(vpp*m+pp-1) for interleaved 1F1B with m a multiple of pp (Narayanan et al. SC'21, 2.2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.pipeline.check import dependencies
from pipetrain.pipeline.schedules import BACKWARD, FORWARD, Action, ScheduleTable


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`; times are in the units of the costs.

    Attributes:
        spans: per rank, (action, start, end) in run order.
        makespan: end of the last action of any rank.
        bubble: per rank, idle share of the makespan (0..1).
        peak_in_flight: per rank, the most microbatches whose activations were alive at once
            (forward done, backward not yet), counted per (stage, microbatch).
    """

    spans: dict[int, list[tuple[Action, float, float]]]
    makespan: float
    bubble: dict[int, float]
    peak_in_flight: dict[int, int]


def simulate(table: ScheduleTable, *, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Simulation:
    """Simulate ``table`` (which must pass ``check``) with fixed costs per action.

    Args:
        table: the task table.
        forward: cost of one F on one stage.
        backward: cost of one B on one stage.
        comm: latency of one cross-rank message (activation or its gradient).

    Raises:
        RuntimeError: the table cannot make progress (call ``check`` first for a precise error).
    """
    cost = {FORWARD: forward, BACKWARD: backward}
    n = table.num_stages
    end: dict[Action, float] = {}
    free = dict.fromkeys(table.actions, 0.0)
    ptr = dict.fromkeys(table.actions, 0)
    spans: dict[int, list[tuple[Action, float, float]]] = {r: [] for r in table.actions}
    remaining = sum(len(a) for a in table.actions.values())
    while remaining:
        progressed = False
        for rank, acts in table.actions.items():
            while ptr[rank] < len(acts):
                a = acts[ptr[rank]]
                deps = dependencies(a, n)
                if any(d not in end for d in deps):
                    break
                arrival = max((end[d] + (comm if table.placement[d.stage] != rank else 0.0) for d in deps), default=0.0)
                start = max(free[rank], arrival)
                end[a] = free[rank] = start + cost[a.kind]
                spans[rank].append((a, start, end[a]))
                ptr[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {table.name!r} cannot make progress; run check() for details")
    makespan = max(free.values(), default=0.0)
    bubble = {r: (1.0 - sum(e - s for _, s, e in sp) / makespan) if makespan else 0.0 for r, sp in spans.items()}
    return Simulation(spans=spans, makespan=makespan, bubble=bubble, peak_in_flight=_peak_in_flight(table))


def _peak_in_flight(table: ScheduleTable) -> dict[int, int]:
    peaks = {}
    for rank, acts in table.actions.items():
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == FORWARD else -1 if a.kind == BACKWARD else 0
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks
