"""Measured pipeline timelines: what every rank did, when, and how much of the step it idled.

The executor times every compute action of every step (``time.perf_counter_ns``, two clock reads
per action). Every ``every_n_steps`` steps :class:`PipelineTimeline` gathers the last step's
timings of all pp ranks to the first rank, which

- writes ``timeline.json`` (Chrome trace, all ranks, seconds; open it in Perfetto) and
  ``timeline.png`` (Gantt chart) into the run dir, and logs the picture to wandb;
- computes each rank's measured bubble: the share of the step's wall time (first action start to
  last action end over all ranks) in which the rank ran no compute action;
- feeds the simulator (:mod:`pipetrain.pipeline.simulate`) with the measured mean cost of each
  (action kind, stage) and the measured latency of one message between ranks, and keeps its
  per-rank bubble, the prediction for those costs.

Ranks on one host share ``perf_counter``'s clock (CLOCK_MONOTONIC), so their spans line up.
Across hosts the clocks differ: each rank's spans are then placed relative to its own step start
and its bubble is measured against the longest rank's step.
"""

from __future__ import annotations

import socket
import statistics
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from pipetrain.pipeline.check import requires
from pipetrain.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from pipetrain.pipeline.simulate import simulate
from pipetrain.pipeline.timeline import bubble_fractions, draw_gantt, write_chrome_trace


def step_spans(records: list[dict]) -> tuple[dict[int, list], float]:
    """Per pp rank, (action, start, end) in seconds from the step start; and the step's wall time.

    ``records[r]`` is rank r's ``{"host", "span": (start_ns, end_ns), "timings": [(action,
    start_ns, end_ns), ...]}``.
    """
    same_host = len({rec["host"] for rec in records}) == 1
    if same_host:
        origin = min(rec["span"][0] for rec in records)
        offsets = [origin] * len(records)
    else:
        offsets = [rec["span"][0] for rec in records]
    spans = {
        r: [(a, (s - off) / 1e9, (e - off) / 1e9) for a, s, e in rec["timings"]]
        for r, (rec, off) in enumerate(zip(records, offsets, strict=True))
    }
    ends = [max((e for _, _, e in sp), default=0.0) for sp in spans.values()]
    starts = [min((s for _, s, _ in sp), default=0.0) for sp in spans.values()]
    wall = max(ends) - (min(starts) if same_host else 0.0)
    return spans, wall


def measured_bubble(spans: dict[int, list], wall: float) -> dict[int, float]:
    """Per rank, 1 - (time in compute actions) / wall."""
    return bubble_fractions(spans, makespan=wall)


def mean_costs(steps: list[dict[int, list]], num_stages: int) -> dict[str, list[float]]:
    """Mean measured seconds of each kind on each stage over ``steps`` (0 where never run)."""
    durations: dict[tuple[str, int], list[float]] = {}
    for spans in steps:
        for sp in spans.values():
            for a, s, e in sp:
                durations.setdefault((a.kind, a.stage), []).append(e - s)
    return {
        kind: [statistics.fmean(durations.get((kind, s), [0.0])) for s in range(num_stages)]
        for kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    }


def comm_latency(steps: list[dict[int, list]], table) -> float:
    """Median seconds from a message's producer ending to its consumer starting, over the cross-rank
    messages the consumer sat waiting for (its rank was idle when the producer ended); 0 if none.

    Needs the ranks' clocks to agree (one host).
    """
    samples = []
    n = table.num_stages
    for spans in steps:
        end = {(a.stage, a.kind, a.microbatch): e for sp in spans.values() for a, _, e in sp}
        for rank, sp in spans.items():
            for i, (a, start, _) in enumerate(sp):
                idle_since = sp[i - 1][2] if i else float("-inf")
                for kind, stage, mb in requires(a, n):
                    if stage == a.stage or table.placement[stage] == rank:
                        continue
                    producer = (stage, FORWARD, mb) if kind == "act" else None
                    if producer is None:
                        producer = (
                            (stage, BACKWARD_INPUT, mb) if (stage, BACKWARD_INPUT, mb) in end else (stage, BACKWARD, mb)
                        )
                    ready = end.get(producer)
                    if ready is not None and idle_since <= ready <= start:
                        samples.append(start - ready)
    return statistics.median(samples) if samples else 0.0


class PipelineTimeline(Callback):
    """Gather, draw and summarise measured timelines every ``every_n_steps`` training steps.

    Steps up to ``warmup_steps`` are not recorded (first steps pay for allocation and warm-up);
    the last step is always recorded. Results (first rank only): :attr:`steps`,
    :meth:`summary` for summary.json. When training starts, global rank 0 also writes the task
    table it runs to schedule.txt (so a run that fails has it too).

    Args:
        every_n_steps: gather period in optimizer steps (0 disables the timelines).
        run_dir: where schedule.txt, timeline.json and timeline.png go.
        max_steps: the run's last step, always recorded.
        warmup_steps: steps not recorded at the start (unless the run is that short).
    """

    def __init__(self, *, every_n_steps: int, run_dir: Path, max_steps: int, warmup_steps: int = 1):
        self.every_n_steps = every_n_steps
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.warmup_steps = warmup_steps
        self.steps: list[int] = []
        self.recorded: list[dict[int, list]] = []
        self.measured: list[dict[int, float]] = []
        self._table = None
        self._same_host: bool | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            from pipetrain.pipeline.render import render_grid, render_table

            table = trainer.strategy.table
            (self.run_dir / "schedule.txt").write_text(render_table(table) + "\n\n" + render_grid(table) + "\n")

    def _due(self, step: int) -> bool:
        if not self.every_n_steps:
            return False
        if step == self.max_steps:
            return True
        return step % self.every_n_steps == 0 and step > self.warmup_steps

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = len(pl_module.train_losses)
        if not self._due(step):
            return
        strategy = trainer.strategy
        executor = strategy.train_executor
        record = {"host": socket.gethostname(), "span": executor.step_span_ns, "timings": executor.timings}
        records = strategy.gather_pipeline(record)
        if not trainer.is_global_zero or records is None:
            return
        self._table = executor.table
        self._same_host = len({rec["host"] for rec in records}) == 1
        spans, wall = step_spans(records)
        self.steps.append(step)
        self.recorded.append(spans)
        self.measured.append(measured_bubble(spans, wall))
        sim = self.simulated()
        measured = self.measured[-1]
        title = (
            f"{self._table.name} pp={self._table.pp} vpp={self._table.vpp} m={self._table.num_microbatches}, "
            f"step {step}\nbubble measured "
            + "/".join(f"{measured[r]:.2f}" for r in sorted(measured))
            + ", simulated "
            + "/".join(f"{sim[r]:.2f}" for r in sorted(sim))
        )
        meta = {"step": step, "schedule": self._table.name, "bubble_measured": measured, "bubble_simulated": sim}
        write_chrome_trace(spans, self.run_dir / "timeline.json", time_scale_us=1e6, name=title, metadata=meta)
        png = draw_gantt(spans, self.run_dir / "timeline.png", title=title, time_label="time (s)", makespan=wall)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="timeline", images=[str(png)], step=trainer.global_step, caption=[title])

    def simulated(self) -> dict[int, float]:
        """Per rank bubble the simulator predicts from the mean measured action costs."""
        costs = mean_costs(self.recorded, self._table.num_stages)
        sim = simulate(
            self._table,
            forward=costs[FORWARD],
            backward=costs[BACKWARD],
            backward_input=costs[BACKWARD_INPUT],
            backward_weight=costs[BACKWARD_WEIGHT],
            comm=self.comm_latency,
        )
        return sim.bubble

    @property
    def comm_latency(self) -> float:
        """Measured latency of one message between ranks (see :func:`comm_latency`), seconds."""
        if self._same_host is False:
            return 0.0
        return comm_latency(self.recorded, self._table)

    def summary(self) -> dict[str, Any]:
        """``bubble_fraction_measured`` (per pp rank, mean over recorded steps),
        ``bubble_fraction_simulated`` (per pp rank) and ``timeline_steps``; empty when nothing
        was recorded."""
        if not self.recorded:
            return {}
        ranks = sorted(self.measured[0])
        sim = self.simulated()
        return {
            "bubble_fraction_measured": [statistics.fmean(m[r] for m in self.measured) for r in ranks],
            "bubble_fraction_simulated": [sim[r] for r in ranks],
            "comm_latency_s": self.comm_latency,
            "timeline_steps": self.steps,
        }
