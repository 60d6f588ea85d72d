"""Pipeline schedules: pure generators of task tables, registered by name.

A generator is ``(pp, vpp, num_microbatches) -> {rank: [Action, ...]}``: for every pp rank, the
ordered actions it runs in one optimizer step. The executor interprets actions and never asks
which schedule made them, so a new schedule is one function plus one ``SCHEDULES`` entry.

Actions use torch.distributed.pipelining's notation: ``"2F0"`` is stage 2, forward, microbatch 0;
``"2B0"`` its full backward.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipetrain.pipeline.partition import PLACEMENTS, placement_table

FORWARD = "F"
BACKWARD = "B"
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

# Communication actions of a lowered table (torch.distributed.pipelining's names). "1SEND_F0": stage
# 1 sends its output of microbatch 0 to stage 2; "2RECV_F0": stage 2 receives that input;
# "2SEND_B0": stage 2 sends the gradient of its input to stage 1; "1RECV_B0": stage 1 receives it.
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE_KINDS + COMM_KINDS

_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+)(\d+)$")
_TORCH_SHARDING_RE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on global ``stage`` for ``microbatch``.

    ``kind`` is F (forward), B (full backward), I (backward for the stage input only), W (backward
    for the weights only, after the I of the same microbatch), or one of the communication kinds
    SEND_F, RECV_F, SEND_B, RECV_B of a lowered table.
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"``-style text (also ``"2I0"``, ``"2W0"``, ``"1SEND_F0"``, ...).

        Raises:
            ValueError: text is not <stage><kind><microbatch> with a known kind.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None or match.group(2) not in KINDS:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '2F0', '2B0', '2I0', '2W0' (kinds {KINDS})")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


GeneratorFn = Callable[[int, int, int], dict[int, list[Action]]]
SizesFn = Callable[[int, int, int], str | None]


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

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        """``rank``'s compute actions (F, B, I, W) in order, without communication actions."""
        return tuple(a for a in self.actions[rank] if a.is_compute)

    @property
    def split_backward(self) -> bool:
        """Whether any action is an I or a W (the backward is split)."""
        return any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for acts in self.actions.values() for a in acts)

    def to_csv(self) -> str:
        """The table in torch.distributed.pipelining's CSV format: row r = rank r's actions."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for rank in range(self.pp):
            writer.writerow([str(a) for a in self.actions[rank]])
        return buffer.getvalue()

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
    unsupported: SizesFn
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


# --------------------------------------------------------------------------------------------
# Looped BFS
# --------------------------------------------------------------------------------------------


def looped_bfs(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """Breadth-first pipeline (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023).

    Loop placement; each rank runs every microbatch through its first local stage, then its next
    one, ...; then the backwards of its last local stage for every microbatch, newest first, then
    of the one before. All microbatches of a stage run back to back, which is what lets data
    parallelism overlap its gradient reduction with the next stage's compute.
    pp=4, vpp=2, m=4, simulated with F=1, B=2 per stage; capitals are the first local stage (r),
    lower case the second (r + 4)::

        rank 0: F0 F1 F2 F3 f0 f1 f2 f3 .  .  .  .  .  .  .  .  .  b3 b3 b2 b2 b1 b1 b0 b0 B3 B3 B2 B2 B1 B1 B0 B0
        rank 1: .  F0 F1 F2 F3 f0 f1 f2 f3 .  .  .  .  .  .  b3 b3 b2 b2 b1 b1 b0 b0 B3 B3 B2 B2 B1 B1 B0 B0 .  .
        rank 2: .  .  F0 F1 F2 F3 f0 f1 f2 f3 .  .  .  b3 b3 b2 b2 b1 b1 b0 b0 B3 B3 B2 B2 B1 B1 B0 B0 .  .  .  .
        rank 3: .  .  .  F0 F1 F2 F3 f0 f1 f2 f3 b3 b3 b2 b2 b1 b1 b0 b0 B3 B3 B2 B2 B1 B1 B0 B0 .  .  .  .  .  .

    Peak activations: vpp * m microbatch-stages per rank (like GPipe).
    """
    table = {}
    m = num_microbatches
    for r in range(pp):
        stages = _local_stages(r, pp, vpp)
        fwd = [Action(s, FORWARD, mb) for s in stages for mb in range(m)]
        bwd = [Action(s, BACKWARD, mb) for s in reversed(stages) for mb in reversed(range(m))]
        table[r] = fwd + bwd
    return table


# --------------------------------------------------------------------------------------------
# Zero bubble: ZB-H1 and interleaved zero bubble
# --------------------------------------------------------------------------------------------


def _zero_bubble_1f1b(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """1F1B (interleaved when vpp > 1) with each B split into I and a W that is deferred.

    Rank r warms up with ``(vpp - 1) * pp + (pp - 1 - r)`` forwards: the interleaved warm-up
    with one slot per hop instead of two, because an I costs about half a B. The steady state
    alternates F and I as 1F1B alternates F and B. Rank r runs its first r I's without a W; from
    then on each I is followed by the oldest deferred W, and the r deferred W's fill the
    cool-down, where 1F1B's rank r waits for gradients. Rank r then holds at most pp microbatches
    whose W has not run, which is rank 0's 1F1B peak.
    """
    m = num_microbatches
    total = m * vpp
    order = _interleaved_order(pp, vpp, m)
    table = {}
    for r in range(pp):
        stages = _local_stages(r, pp, vpp)
        fwd = [Action(stages[c], FORWARD, mb) for c, mb in order]
        inputs = [Action(stages[vpp - 1 - c], BACKWARD_INPUT, mb) for c, mb in order]
        warmup = min(total, (vpp - 1) * pp + (pp - 1 - r))
        acts = fwd[:warmup]
        deferred: list[Action] = []
        for i, grad_input in enumerate(inputs):
            if warmup + i < total:
                acts.append(fwd[warmup + i])
            acts.append(grad_input)
            deferred.append(Action(grad_input.stage, BACKWARD_WEIGHT, grad_input.microbatch))
            if i >= r:
                acts.append(deferred.pop(0))
        table[r] = acts + deferred
    return table


def zb_h1(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1).

    1F1B with each backward split into I (gradient of the stage input: on the critical path, it
    is what the previous stage waits for) and W (gradient of the weights: needed only by the
    optimizer). Rank r defers its first r W's; they run in the cool-down, where 1F1B's rank r
    idles. With costs F, I, W each rank idles (pp - 1)(F + I - W) per step instead of 1F1B's
    (pp - 1)(F + B): a third of it when F = I = W. At most pp microbatches' activations are alive
    on any rank, the peak of 1F1B (on its rank 0). pp=4, m=8, simulated with F = I = W = 1::

        rank 0: F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
        rank 1: .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7
        rank 2: .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7
        rank 3: .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7
    """
    return _zero_bubble_1f1b(pp, vpp, num_microbatches)


def interleaved_zb(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """Interleaved 1F1B with split backward (Qi et al., "Zero Bubble Pipeline Parallelism",
    ICLR 2024, the ZB-H1 idea applied to Megatron's interleaved schedule; torch's
    ScheduleInterleavedZeroBubble builds the same order).

    Loop placement, microbatches in groups of pp as in interleaved_1f1b; I replaces B on the
    critical path and rank r defers its first r W's into the cool-down. pp=4, vpp=2, m=4
    (F = I = W = 1; capitals are stage r, lower case stage r + 4)::

        rank 0: F0 F1 F2 F3 f0 f1 f2 f3 .  .  .  i0 w0 i1 w1 i2 w2 i3 w3 I0 W0 I1 W1 I2 W2 I3 W3
        rank 1: .  F0 F1 F2 F3 f0 f1 f2 .  .  i0 f3 i1 w0 i2 w1 i3 w2 I0 w3 I1 W0 I2 W1 I3 W2 W3
        rank 2: .  .  F0 F1 F2 F3 f0 f1 .  i0 f2 i1 f3 i2 w0 i3 w1 I0 w2 I1 w3 I2 W0 I3 W1 W2 W3
        rank 3: .  .  .  F0 F1 F2 F3 f0 i0 f1 i1 f2 i2 f3 i3 w0 I0 w1 I1 w2 I2 w3 I3 W0 W1 W2 W3
    """
    return _zero_bubble_1f1b(pp, vpp, num_microbatches)


# --------------------------------------------------------------------------------------------
# ZB-V
# --------------------------------------------------------------------------------------------


def zbv(pp: int, vpp: int, num_microbatches: int) -> dict[int, list[Action]]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6).

    V placement: rank r holds stages ``a = r`` and ``b = 2 pp - 1 - r``, so a microbatch goes down
    the ranks through the a-stages and back up through the b-stages, and rank 0 holds both the
    embedding and the head. Rank r runs, with ``n = max(m, 2 pp - 1)`` microbatches:

    1. ``2 (pp - r) - 1`` forwards of a;
    2. r times: F of b, F of a;
    3. ``pp - r`` times: F, I, W of b;
    4. steady state, until every F has run: F of a (while any is left), I and W of a, F, I, W
       of b;
    5. cool-down: r times I of a, I of b; then ``pp - r`` times I of a and its oldest W;
       then the remaining W's of b, then of a.

    Actions of microbatches m..n-1 (only when m < 2 pp - 1) are then dropped. With
    F = I = W the steady state has no bubble, and each rank holds at most 2 pp microbatch-stages
    of activations (1F1B's peak, since every stage is half a rank's layers). pp=4, m=4, F = I = W = 1,
    capitals stage r, lower case stage 2 pp - 1 - r (with m < 2 pp - 1 the cool-down keeps gaps)::

        rank 0: F0 F1 F2 F3 .  .  .  f0 i0 w0 f1 i1 w1 f2 i2 w2 f3 i3 w3 I0 W0 .  I1 W1 .  I2 W2 .  I3 W3
        rank 1: .  F0 F1 F2 F3 .  f0 .  f1 i0 w0 f2 i1 w1 f3 i2 w2 I0 W0 i3 w3 I1 W1 .  I2 W2 .  I3 W3 .
        rank 2: .  .  F0 F1 F2 f0 F3 f1 .  f2 i0 w0 f3 i1 w1 I0 W0 i2 w2 I1 W1 i3 w3 I2 W2 .  I3 W3 .  .
        rank 3: .  .  .  F0 f0 F1 f1 F2 f2 F3 f3 i0 w0 I0 W0 i1 w1 I1 W1 i2 w2 I2 W2 i3 w3 I3 W3 .  .  .
    """
    m = num_microbatches
    n = max(m, 2 * pp - 1)
    table = {}
    for r in range(pp):
        a, b = r, 2 * pp - 1 - r
        count = {(a, FORWARD): 0, (a, BACKWARD_INPUT): 0, (b, FORWARD): 0, (b, BACKWARD_INPUT): 0}
        deferred: dict[int, list[Action]] = {a: [], b: []}
        acts: list[Action] = []

        def run(stage: int, kind: str, acts: list[Action] = acts, count=count, deferred=deferred) -> None:
            mb = count[(stage, kind)]
            count[(stage, kind)] += 1
            acts.append(Action(stage, kind, mb))
            if kind == BACKWARD_INPUT:
                deferred[stage].append(Action(stage, BACKWARD_WEIGHT, mb))

        def weight(stage: int, acts: list[Action] = acts, deferred=deferred) -> None:
            acts.append(deferred[stage].pop(0))

        for _ in range(2 * (pp - r) - 1):
            run(a, FORWARD)
        for _ in range(r):
            run(b, FORWARD)
            run(a, FORWARD)
        for _ in range(pp - r):
            run(b, FORWARD)
            run(b, BACKWARD_INPUT)
            weight(b)
        while count[(b, FORWARD)] < count[(a, FORWARD)] or count[(a, FORWARD)] < n:
            if count[(a, FORWARD)] < n:
                run(a, FORWARD)
            run(a, BACKWARD_INPUT)
            weight(a)
            run(b, FORWARD)
            run(b, BACKWARD_INPUT)
            weight(b)
        for _ in range(r):
            run(a, BACKWARD_INPUT)
            run(b, BACKWARD_INPUT)
        for _ in range(pp - r):
            run(a, BACKWARD_INPUT)
            weight(a)
        acts += deferred[b] + deferred[a]
        table[r] = [x for x in acts if x.microbatch < m]
    return table


# --------------------------------------------------------------------------------------------
# sizes each schedule accepts
# --------------------------------------------------------------------------------------------


def _one_stage_per_rank(name: str, multi: str) -> SizesFn:
    """Sizes rule of a schedule that runs one stage per rank; ``multi`` is its vpp >= 2 sibling."""

    def unsupported(pp: int, vpp: int, m: int) -> str | None:
        if vpp != 1:
            return f"schedule {name} runs one stage per rank: parallel.vpp={vpp} must be 1 (use schedule={multi})"
        return None

    return unsupported


def _several_stages_per_rank(name: str, single: str, *, groups_of_pp: bool) -> SizesFn:
    """Sizes rule of a schedule with vpp >= 2 stages per rank; ``single`` is its one-stage sibling.

    ``groups_of_pp``: microbatches go in groups of pp (Megatron's interleaving), so m must be a
    multiple of pp (any m when pp == 1, where every stage is local).
    """

    def unsupported(pp: int, vpp: int, m: int) -> str | None:
        if vpp < 2:
            return f"schedule {name} needs parallel.vpp >= 2, got {vpp} (use schedule={single} for one stage per rank)"
        if groups_of_pp and pp > 1 and m % pp != 0:
            return (
                f"schedule {name} needs parallel.num_microbatches to be a multiple of "
                f"parallel.pp={pp}, got {m}; use {max(pp, m - m % pp)} or {m + pp - m % pp}"
            )
        return None

    return unsupported


def _zbv_sizes(pp: int, vpp: int, m: int) -> str | None:
    if vpp != 2:
        return f"schedule zbv places exactly two stages on each rank (a V): parallel.vpp={vpp} must be 2"
    return None


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, _any_sizes),
    "1f1b": ScheduleSpec(one_f_one_b, _one_stage_per_rank("1f1b", "interleaved_1f1b")),
    "interleaved_1f1b": ScheduleSpec(
        interleaved_1f1b, _several_stages_per_rank("interleaved_1f1b", "1f1b", groups_of_pp=True)
    ),
    "looped_bfs": ScheduleSpec(looped_bfs, _several_stages_per_rank("looped_bfs", "gpipe", groups_of_pp=False)),
    "zb_h1": ScheduleSpec(zb_h1, _one_stage_per_rank("zb_h1", "interleaved_zb")),
    "zbv": ScheduleSpec(zbv, _zbv_sizes, placement="v"),
    "interleaved_zb": ScheduleSpec(
        interleaved_zb, _several_stages_per_rank("interleaved_zb", "zb_h1", groups_of_pp=True)
    ),
}


CSV = "csv"


def schedule_names() -> list[str]:
    """Every name ``schedule.name`` accepts: the registered generators and ``csv``."""
    return sorted(SCHEDULES) + [CSV]


def get_schedule(name: str) -> ScheduleSpec:
    """The registered schedule ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule.name={name!r} is not a known schedule; use one of {schedule_names()}")
    return SCHEDULES[name]


def build_schedule(
    name: str, *, pp: int, vpp: int, num_microbatches: int, path: str | os.PathLike | None = None
) -> ScheduleTable:
    """The task table of schedule ``name`` for the given sizes (not yet checked).

    ``name="csv"`` reads the table from ``path`` (see :func:`read_csv_table`) and requires its
    sizes to be the given ones.

    Raises:
        ValueError: unknown schedule, a size below 1, sizes the schedule does not support, or a
            CSV file that is missing, unreadable or of other sizes; the message names the config
            key, the value and what would work.
    """
    for key, value in (
        ("parallel.pp", pp),
        ("parallel.vpp", vpp),
        ("parallel.num_microbatches", num_microbatches),
    ):
        if value < 1:
            raise ValueError(f"{key}={value} must be >= 1")
    if name == CSV:
        if path is None:
            raise ValueError("schedule=csv needs schedule.path=<file.csv>: one row per rank, actions like 0F0,0B0")
        table = read_csv_table(path)
        for key, want, got in (
            ("parallel.pp", pp, table.pp),
            ("parallel.vpp", vpp, table.vpp),
            ("parallel.num_microbatches", num_microbatches, table.num_microbatches),
        ):
            if want != got:
                raise ValueError(
                    f"schedule.path={os.fspath(path)} holds a table for {key}={got}, but {key}={want}; set {key}={got}"
                )
        return table
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


def read_csv_table(path: str | os.PathLike, *, name: str = CSV) -> ScheduleTable:
    """Read a task table from a CSV file in torch.distributed.pipelining's format.

    Row r lists rank r's actions in order, one per cell (``0F0,0F1,1B0``); empty cells (torch
    writes its idle slots as empty cells) are skipped. Communication actions (``1SEND_F0``) are
    kept, and ``check`` verifies them. The sizes and the placement are inferred: pp = the number
    of rows, stages = the highest stage + 1, vpp = stages / pp, microbatches = the highest
    microbatch + 1, and a stage lives on the first rank whose row names it (``check`` rejects a
    stage that appears on two ranks). torch's parameter-sharding actions (``0UNSHARD``,
    ``0RESHARD``, ``0REDUCE_GRAD``: FSDP hooks of its lowered tables) are skipped: pipetrain
    stages hold their parameters whole. Overlapped cells (``(0F3;3B1)OVERLAP_F_B``, torch's
    DualPipeV) are not supported and are reported as unparsable.

    Raises:
        ValueError: the file is missing or unreadable, a cell is not an action, or the sizes are
            inconsistent; the message names the file, and the row and cell where it applies.
    """
    path = Path(path)
    try:
        with path.open(newline="") as handle:
            rows = list(csv.reader(handle))
    except OSError as err:
        raise ValueError(f"schedule.path={path}: cannot read the schedule CSV: {err.strerror or err}") from err
    except (UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"schedule.path={path}: not a schedule CSV: {err}") from err
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise ValueError(f"schedule.path={path}: the file is empty; expected one row of actions per rank")
    actions: dict[int, tuple[Action, ...]] = {}
    for rank, row in enumerate(rows):
        parsed = []
        for column, cell in enumerate(row):
            if not cell.strip() or _TORCH_SHARDING_RE.match(cell.strip()):
                continue
            try:
                parsed.append(Action.parse(cell))
            except ValueError as err:
                where = f"schedule.path={path}: row {rank + 1} (rank {rank}) cell {column + 1}"
                raise ValueError(f"{where}: {err}") from None
        actions[rank] = tuple(parsed)
    every = [a for acts in actions.values() for a in acts]
    if not every:
        raise ValueError(f"schedule.path={path}: no actions in the file")
    pp = len(rows)
    num_stages = 1 + max(a.stage for a in every)
    if num_stages % pp:
        raise ValueError(
            f"schedule.path={path}: {num_stages} stages (0..{num_stages - 1}) cannot be spread evenly over "
            f"{pp} ranks (rows); every rank must hold the same number of stages"
        )
    home: dict[int, int] = {}
    for rank, acts in actions.items():
        for a in acts:
            home.setdefault(a.stage, rank)
    missing = [s for s in range(num_stages) if s not in home]
    if missing:
        raise ValueError(f"schedule.path={path}: stages {missing} appear in no row")
    # A stage named on two rows is left to check(), which names the rank, step and action.
    on_two_ranks = any(home[a.stage] != r for r, acts in actions.items() for a in acts)
    per_rank = Counter(home.values())
    uneven = [r for r in range(pp) if per_rank[r] != num_stages // pp]
    if uneven and not on_two_ranks:
        rank = uneven[0]
        raise ValueError(
            f"schedule.path={path}: row {rank + 1} (rank {rank}) holds {per_rank[rank]} stages, but "
            f"{num_stages} stages over {pp} ranks means {num_stages // pp} on every rank"
        )
    return ScheduleTable(
        name=name,
        pp=pp,
        vpp=num_stages // pp,
        num_microbatches=1 + max(a.microbatch for a in every),
        placement=tuple(home[s] for s in range(num_stages)),
        actions=actions,
    )


def gpipe_on(table: ScheduleTable) -> ScheduleTable:
    """GPipe over ``table``'s sizes and placement (any placement, also one read from a CSV).

    Each rank runs the forwards of its stages in ascending stage order, every microbatch of one
    stage before the next, then the backwards in reverse. The evaluation loop runs its forwards:
    dependencies go from stage s to s + 1 only, so this order never deadlocks.
    """
    acts = {}
    for r in range(table.pp):
        stages = [s for s in range(table.num_stages) if table.placement[s] == r]
        m = range(table.num_microbatches)
        fwd = [Action(s, FORWARD, mb) for s in stages for mb in m]
        acts[r] = tuple(fwd + [Action(s, BACKWARD, mb) for s in reversed(stages) for mb in m])
    return ScheduleTable("gpipe", table.pp, table.vpp, table.num_microbatches, table.placement, acts)


def resolve_placement(table: ScheduleTable, placement: str) -> tuple[int, ...]:
    """The stage placement to partition the model by: ``table``'s own, which ``placement`` (the
    ``parallel.placement`` setting: "auto", "loop" or "v") may name but not contradict.

    Raises:
        ValueError: ``placement`` is unknown or differs from the placement the schedule needs.
    """
    if placement == "auto":
        return table.placement
    if placement not in PLACEMENTS:
        raise ValueError(f"parallel.placement={placement!r} is not supported; use one of {('auto', *PLACEMENTS)}")
    wanted = placement_table(pp=table.pp, vpp=table.vpp, placement=placement)
    if wanted != table.placement:
        raise ValueError(
            f"parallel.placement={placement} puts stages on ranks {list(wanted)}, but schedule {table.name} "
            f"runs them on ranks {list(table.placement)}; use parallel.placement=auto (the schedule's own)"
        )
    return table.placement


def write_csv_table(table: ScheduleTable, path: str | os.PathLike) -> Path:
    """Write ``table`` in the CSV format :func:`read_csv_table` (and torch) reads; return the path."""
    path = Path(path)
    path.write_text(table.to_csv())
    return path
