"""Pipeline schedules: pure generators of task tables, registered by name.

A generator is ``(pp, vpp, num_microbatches) -> {rank: [Action, ...]}``: for every pp rank, the
ordered actions it runs in one optimizer step. The executor interprets actions and never asks
which schedule made them, so a new schedule is one function plus one ``SCHEDULES`` entry.

Actions use torch.distributed.pipelining's notation: ``"2F0"`` is stage 2, forward, microbatch 0;
``"2B0"`` its full backward.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pipetrain.pipeline.partition import placement_table

FORWARD = "F"
BACKWARD = "B"
KINDS = (FORWARD, BACKWARD)

_ACTION_RE = re.compile(r"^(\d+)([A-Z])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``kind`` in {"F", "B"} on global ``stage`` for ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"``-style text.

        Raises:
            ValueError: text is not <stage><kind><microbatch> with a known kind.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None or match.group(2) not in KINDS:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '2F0' or '2B0' (kinds {KINDS})")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


GeneratorFn = Callable[[int, int, int], dict[int, list[Action]]]


@dataclass(frozen=True)
class ScheduleTable:
    """A complete task table and the facts needed to run and check it.

    Attributes:
        name: the registered schedule name that produced it.
        pp, vpp, num_microbatches: the sizes it was built for.
        placement: element s is the rank that holds stage s.
        actions: for every rank 0..pp-1, its ordered actions.
    """

    name: str
    pp: int
    vpp: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: dict[int, tuple[Action, ...]]

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def local_chunk(self, stage: int) -> int:
        """Index of ``stage`` among the stages of its own rank (ascending stage order)."""
        rank = self.placement[stage]
        return sum(1 for s in range(stage) if self.placement[s] == rank)

    def to_json(self) -> dict:
        """``{"pp", "vpp", "num_microbatches", "placement": {stage: rank}, "actions": {rank: [...]}}``."""
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "num_microbatches": self.num_microbatches,
            "placement": {str(s): r for s, r in enumerate(self.placement)},
            "actions": {str(r): [str(a) for a in acts] for r, acts in self.actions.items()},
        }


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: its generator and the sizes it supports.

    ``unsupported(pp, vpp, m)`` returns None when the sizes are accepted, otherwise one sentence
    naming the offending key and what would work.
    """

    generate: GeneratorFn
    unsupported: Callable[[int, int, int], str | None]
    placement: str = "loop"


def _local_stages(rank: int, pp: int, vpp: int) -> list[int]:
    return [rank + k * pp for k in range(vpp)]


# --------------------------------------------------------------------------------------------
# GPipe
# --------------------------------------------------------------------------------------------


def gpipe(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """GPipe: every forward, then every backward (Huang et al., "GPipe", NeurIPS 2019, section 2.2).

    With vpp > 1 each rank runs its local stages breadth first (all microbatches of its first
    stage, then of its next one); backwards go in reverse stage order. pp=4, vpp=1, m=4 (one
    column = one forward; a backward takes two)::

        rank 0: F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
        rank 1: .  F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .
        rank 2: .  .  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
        rank 3: .  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3

    Bubble fraction (pp - 1) / (m + pp - 1); peak activations: m microbatches per stage.
    """
    table = {}
    for r in range(pp):
        stages = _local_stages(r, pp, vpp)
        fwd = [Action(s, FORWARD, mb) for s in stages for mb in range(num_microbatches)]
        bwd = [Action(s, BACKWARD, mb) for s in reversed(stages) for mb in range(num_microbatches)]
        table[r] = fwd + bwd
    return table


def _any_sizes(pp: int, vpp: int, m: int) -> str | None:
    return None


# --------------------------------------------------------------------------------------------
# 1F1B
# --------------------------------------------------------------------------------------------


def one_f_one_b(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """1F1B / PipeDream-flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
    Training", ICML 2021, section 3; also Megatron-LM, SC'21, section 2.2.1).

    Rank r runs ``min(m, pp - r)`` forwards before its first backward (warm-up), then alternates
    one backward and one forward (steady state), then drains the remaining backwards
    (cool-down). pp=4, m=8, F one column, B two::

        rank 0: F0 F1 F2 F3 .  .  .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 F6 B3 B3 F7 B4 B4 ...
        rank 1: .  F0 F1 F2 .  .  .  B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3 F6 ...
        rank 2: .  .  F0 F1 .  B0 B0 F2 B1 B1 F3 B2 B2 F4 ...
        rank 3: .  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 ...

    Same bubble as GPipe, (pp - 1) / (m + pp - 1), but at most ``pp - r`` microbatches'
    activations are alive on rank r instead of m.
    """
    table = {}
    m = num_microbatches
    for r in range(pp):
        (stage,) = _local_stages(r, pp, vpp)
        warmup = min(m, pp - r - 1)
        acts = [Action(stage, FORWARD, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            acts.append(Action(stage, FORWARD, warmup + i))
            acts.append(Action(stage, BACKWARD, i))
        acts += [Action(stage, BACKWARD, mb) for mb in range(m - warmup, m)]
        table[r] = acts
    return table


def _needs_vpp_1(pp: int, vpp: int, m: int) -> str | None:
    if vpp != 1:
        return f"schedule 1f1b runs one stage per rank: parallel.vpp={vpp} must be 1 (use schedule=interleaved_1f1b)"
    return None


# --------------------------------------------------------------------------------------------
# Interleaved 1F1B
# --------------------------------------------------------------------------------------------


def interleaved_1f1b(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """Interleaved 1F1B, Megatron-LM's virtual-pipeline schedule (Narayanan et al., "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2.2).

    Microbatches go in groups of pp. Within a group a rank runs the forward of every microbatch
    on its first local stage, then on its second, ...; backwards walk the local stages in reverse.
    Rank r warms up with ``(pp - r - 1) * 2 + (vpp - 1) * pp`` forwards, then alternates one
    forward and one backward, then drains. pp=4, vpp=2, m=4; ``a``/``b`` = first/second local
    stage, one column = one forward (a backward takes two)::

        rank 0: a0 a1 a2 a3 b0 b1 b2 b3 .  .  .  .  .  .  .  .  .  .  bB0 ...
        rank 1: .  a0 a1 a2 a3 b0 b1 b2 b3 .  .  .  .  .  .  .  bB0 ...
        rank 2: .  .  a0 a1 a2 a3 b0 b1 b2 b3 .  .  .  .  bB0 ...
        rank 3: .  .  .  a0 a1 a2 a3 b0 b1 b2 b3 bB0 ...

    Bubble fraction (pp - 1) / (vpp * m + pp - 1) when m is a multiple of pp: vpp times smaller
    than 1F1B's, at the cost of vpp times more point-to-point messages.

    Accepted sizes: vpp >= 2 and m a multiple of pp (Megatron's original rule). With pp = 1 every
    stage is local and any m works.
    """
    m = num_microbatches
    total = m * vpp
    table = {}
    for r in range(pp):
        stages = _local_stages(r, pp, vpp)
        order = _interleaved_order(pp, vpp, m)
        fwd = [Action(stages[c], FORWARD, mb) for c, mb in order]
        bwd = [Action(stages[vpp - 1 - c], BACKWARD, mb) for c, mb in order]
        warmup = min(total, (pp - r - 1) * 2 + (vpp - 1) * pp)
        acts = fwd[:warmup]
        for i in range(total - warmup):
            acts.append(fwd[warmup + i])
            acts.append(bwd[i])
        acts += bwd[total - warmup :]
        table[r] = acts
    return table


def _interleaved_order(pp: int, vpp: int, m: int) -> list[tuple[int, int]]:
    """(local chunk, microbatch) in the order a rank visits them: groups of pp microbatches."""
    order = []
    for first in range(0, m, pp):
        group = range(first, min(first + pp, m))
        order += [(c, mb) for c in range(vpp) for mb in group]
    return order


def _interleaved_sizes(pp: int, vpp: int, m: int) -> str | None:
    if vpp < 2:
        return (
            f"schedule interleaved_1f1b needs parallel.vpp >= 2, got {vpp} (use schedule=1f1b for one stage per rank)"
        )
    if pp > 1 and m % pp != 0:
        return (
            f"schedule interleaved_1f1b needs parallel.num_microbatches to be a multiple of "
            f"parallel.pp={pp}, got {m}; use {max(pp, m - m % pp)} or {m + pp - m % pp}"
        )
    return None


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, _any_sizes),
    "1f1b": ScheduleSpec(one_f_one_b, _needs_vpp_1),
    "interleaved_1f1b": ScheduleSpec(interleaved_1f1b, _interleaved_sizes),
}


def get_schedule(name: str) -> ScheduleSpec:
    """The registered schedule ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule.name={name!r} is not a known schedule; use one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


def build_schedule(name: str, *, pp: int, vpp: int, num_microbatches: int) -> ScheduleTable:
    """Generate the task table of schedule ``name`` for the given sizes (not yet checked).

    Raises:
        ValueError: unknown schedule, a size below 1, or sizes the schedule does not support;
            the message names the config key, the value and what would work.
    """
    for key, value in (
        ("parallel.pp", pp),
        ("parallel.vpp", vpp),
        ("parallel.num_microbatches", num_microbatches),
    ):
        if value < 1:
            raise ValueError(f"{key}={value} must be >= 1")
    spec = get_schedule(name)
    reason = spec.unsupported(pp, vpp, num_microbatches)
    if reason is not None:
        raise ValueError(reason)
    actions = spec.generate(pp, vpp, num_microbatches)
    return ScheduleTable(
        name=name,
        pp=pp,
        vpp=vpp,
        num_microbatches=num_microbatches,
        placement=placement_table(pp=pp, vpp=vpp, placement=spec.placement),
        actions={r: tuple(actions[r]) for r in range(pp)},
    )
