"""Cost-model simulation of a task table. Pure.

Each rank runs its compute actions in order; an action starts when its rank is free and its inputs
have arrived: the producer's end time, plus ``comm`` when the producer is on another rank. Costs
may differ per stage (give a sequence indexed by stage). With unit costs and comm = 0 the makespan
reproduces the closed forms:

- GPipe and 1F1B (F=1, B=2): bubble (pp-1)/(m+pp-1) (Huang et al. 2019; Narayanan et al. 2021);
- interleaved 1F1B, m a multiple of pp: (pp-1)/(vpp*m+pp-1) (Narayanan et al. SC'21, 2.2.2);
- ZB-H1 (m >= pp, W <= I): idle time (pp-1)(F+I-W) per rank, against 1F1B's (pp-1)(F+B) (Qi et
  al., ICLR 2024, section 3.1).

Memory is counted in microbatch-stages: an activation is live from its F until the backward that
frees it (its B, or its W: the I keeps what the W needs), and a weight-gradient input is stashed
from an I until its W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.pipeline.check import produces, requires
from pipetrain.pipeline.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    ScheduleTable,
)

Cost = float | Sequence[float]


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`; times are in the units of the costs.

    Attributes:
        spans: per rank, (action, start, end) of each compute action, in run order.
        makespan: end of the last action of any rank.
        bubble: per rank, idle share of the makespan (0..1).
        idle: per rank, idle time (makespan minus the rank's busy time).
        peak_in_flight: per rank, the most microbatch-stages whose activations were alive at once
            (F done, its B or W not yet).
        peak_weight_stash: per rank, the most microbatch-stages whose I had run and W had not
            (the inputs a deferred W keeps alive); 0 without split backward.
    """

    spans: dict[int, list[tuple[Action, float, float]]]
    makespan: float
    bubble: dict[int, float]
    idle: dict[int, float]
    peak_in_flight: dict[int, int]
    peak_weight_stash: dict[int, int]

    @property
    def max_bubble(self) -> float:
        return max(self.bubble.values(), default=0.0)


def _per_stage(value: Cost, name: str, num_stages: int) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} costs: got {len(values)} values for {num_stages} stages")
    return values


def simulate(
    table: ScheduleTable,
    *,
    forward: Cost = 1.0,
    backward: Cost = 2.0,
    backward_input: Cost | None = None,
    backward_weight: Cost | None = None,
    comm: float = 0.0,
) -> Simulation:
    """Simulate ``table`` (which must pass ``check``) with the given costs.

    Args:
        table: the task table; SEND/RECV actions, if any, are ignored (``comm`` models them).
        forward: cost of one F, one number or one per stage.
        backward: cost of one full B, one number or one per stage.
        backward_input: cost of one I (default: half of ``backward``).
        backward_weight: cost of one W (default: half of ``backward``).
        comm: latency of one cross-rank message (activation or its gradient).

    Raises:
        ValueError: a per-stage cost list of the wrong length.
        RuntimeError: the table cannot make progress (call ``check`` first for a precise error).
    """
    n = table.num_stages
    b = _per_stage(backward, "backward", n)
    cost = {
        FORWARD: _per_stage(forward, "forward", n),
        BACKWARD: b,
        BACKWARD_INPUT: _per_stage(backward_input, "backward_input", n)
        if backward_input is not None
        else [x / 2 for x in b],
        BACKWARD_WEIGHT: _per_stage(backward_weight, "backward_weight", n)
        if backward_weight is not None
        else [x / 2 for x in b],
    }
    actions = {r: table.compute_actions(r) for r in range(table.pp)}
    ready: dict[tuple, float] = {}
    free = dict.fromkeys(actions, 0.0)
    ptr = dict.fromkeys(actions, 0)
    spans: dict[int, list[tuple[Action, float, float]]] = {r: [] for r in actions}
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank, acts in actions.items():
            while ptr[rank] < len(acts):
                a = acts[ptr[rank]]
                deps = requires(a, n)
                if any(d not in ready for d in deps):
                    break
                arrival = max(
                    (ready[d] + (comm if table.placement[d[1]] != rank else 0.0) for d in deps),
                    default=0.0,
                )
                start = max(free[rank], arrival)
                free[rank] = start + cost[a.kind][a.stage]
                for event in produces(a):
                    ready[event] = free[rank]
                spans[rank].append((a, start, free[rank]))
                ptr[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {table.name!r} cannot make progress; run check() for details")
    makespan = max(free.values(), default=0.0)
    busy = {r: sum(e - s for _, s, e in sp) for r, sp in spans.items()}
    return Simulation(
        spans=spans,
        makespan=makespan,
        bubble={r: (1.0 - busy[r] / makespan) if makespan else 0.0 for r in spans},
        idle={r: makespan - busy[r] for r in spans},
        peak_in_flight=_peaks(actions, {FORWARD}, {BACKWARD, BACKWARD_WEIGHT}),
        peak_weight_stash=_peaks(actions, {BACKWARD_INPUT}, {BACKWARD_WEIGHT}),
    )


def _peaks(actions: dict[int, tuple[Action, ...]], opens: set[str], closes: set[str]) -> dict[int, int]:
    peaks = {}
    for rank, acts in actions.items():
        live = peak = 0
        for a in acts:
            live += 1 if a.kind in opens else -1 if a.kind in closes else 0
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


def simulate_rank_share(
    table: ScheduleTable,
    *,
    forward: float,
    backward: float,
    backward_input: float,
    backward_weight: float,
    comm: float = 0.0,
) -> Simulation:
    """:func:`simulate` with costs given for one rank's share of the layers (n_layer / pp): each
    stage costs 1/vpp of them, so tables with different vpp compare at equal work."""
    v = table.vpp
    return simulate(
        table,
        forward=forward / v,
        backward=backward / v,
        backward_input=backward_input / v,
        backward_weight=backward_weight / v,
        comm=comm,
    )
