"""Timelines of a pipeline step, simulated or measured: Chrome traces, Gantt charts, bubbles. Pure.

Every function takes ``spans``: per pp rank, ``(action, start, end)`` in run order, the shape of
``simulate(table).spans``. Times are in any one unit (simulated cost units, or seconds for a
measured run); only ``chrome_trace`` needs to know which, through ``time_scale_us``.

Communication actions (kinds ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) have no width in a
task table and are skipped everywhere; compute kinds are F (forward), B (full backward),
I (backward for inputs) and W (backward for weights), as in zero bubble (Qi et al. ICLR 2024).

Drawing uses matplotlib's object API (``Figure`` + ``FigureCanvasAgg``), never pyplot, so it
touches no global state and needs no display.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pipetrain.pipeline.schedules import Action

Spans = Mapping[int, Sequence[tuple[Action, float, float]]]

# Okabe-Ito colours: distinguishable under the common colour-vision deficiencies.
KIND_STYLE: dict[str, tuple[str, str]] = {
    "F": ("#0072B2", "forward"),
    "B": ("#E69F00", "backward"),
    "I": ("#009E73", "backward (inputs)"),
    "W": ("#CC79A7", "backward (weights)"),
}
_UNKNOWN_COLOUR = "#999999"
_COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})

_DPI = 100
_MIN_WIDTH_IN, _MAX_WIDTH_IN, _WIDTH_PER_ACTION_IN = 6.0, 40.0, 0.35
_MAX_HEIGHT_IN, _HEIGHT_PER_RANK_IN = 30.0, 0.45
# Room for one legend entry (patch and "backward (weights)" at the default font size).
_LEGEND_ENTRY_IN = 2.2
# Later local chunks of a rank are drawn lighter; the last one at this opacity.
_MIN_CHUNK_ALPHA = 0.5


def _compute_spans(spans: Spans) -> dict[int, list[tuple[Action, float, float]]]:
    """Validated copy of ``spans`` without communication actions.

    Raises:
        ValueError: no compute action on any rank, or a span that ends before it starts.
    """
    out: dict[int, list[tuple[Action, float, float]]] = {}
    for rank in sorted(spans):
        kept = []
        for action, start, end in spans[rank]:
            if action.kind in _COMM_KINDS:
                continue
            if end < start:
                raise ValueError(f"span of {action} on rank {rank} ends at {end} before it starts at {start}")
            kept.append((action, float(start), float(end)))
        out[rank] = kept
    if not any(out.values()):
        raise ValueError(
            "spans is empty: no F/B/I/W action on any rank; pass simulate(table).spans or the spans "
            "measured by a run (per rank, a list of (action, start, end))"
        )
    return out


def _extent(spans: Mapping[int, list[tuple[Action, float, float]]]) -> tuple[float, float]:
    starts = [s for sp in spans.values() for _, s, _ in sp]
    ends = [e for sp in spans.values() for _, _, e in sp]
    return min(starts), max(ends)


def chrome_trace(
    spans: Spans, *, time_scale_us: float = 1.0, name: str = "pipeline", metadata: dict | None = None
) -> dict:
    """The timeline as a Chrome Trace Event Format object (opens in Perfetto or chrome://tracing).

    Each compute span becomes one complete event (``"ph": "X"``) named like ``"2F0"``, with
    ``cat`` = kind, ``ts`` = start * time_scale_us and ``dur`` = (end - start) * time_scale_us.
    All ranks are threads (``tid`` = rank) of one process (``pid`` 0) named ``name``: Perfetto
    lays out the threads of a process as adjacent, already expanded rows, whereas one process per
    rank gives a collapsed group per rank that must be opened one by one. Metadata events name the
    rows "rank r" and sort them by rank.

    Args:
        spans: per rank, (action, start, end) in run order; communication actions are skipped.
        time_scale_us: microseconds per time unit of ``spans`` (1e6 for seconds; 1.0 shows
            simulated cost units as microseconds).
        name: the process name shown above the rows.
        metadata: JSON-serialisable facts about the run (schedule, pp, ...) stored as ``otherData``.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": metadata or {}}``.

    Raises:
        ValueError: spans hold no compute action, a span ends before it starts, or
            time_scale_us is not positive.
    """
    if not time_scale_us > 0:
        raise ValueError(f"time_scale_us={time_scale_us} must be positive (microseconds per time unit of spans)")
    compute = _compute_spans(spans)
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": name}}]
    for rank in compute:
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
    for rank, sp in compute.items():
        for action, start, end in sp:
            events.append(
                {
                    "ph": "X",
                    "name": str(action),
                    "cat": action.kind,
                    "pid": 0,
                    "tid": rank,
                    "ts": start * time_scale_us,
                    "dur": (end - start) * time_scale_us,
                    "args": {"stage": action.stage, "microbatch": action.microbatch, "kind": action.kind},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata) if metadata else {}}


def write_chrome_trace(spans: Spans, path: str | Path, **kwargs) -> Path:
    """Write :func:`chrome_trace` of ``spans`` as JSON to ``path`` (parents created).

    Args:
        spans: as in :func:`chrome_trace`.
        path: output file, conventionally ``*.json``.
        **kwargs: keyword arguments of :func:`chrome_trace`.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: as :func:`chrome_trace`.
    """
    trace = chrome_trace(spans, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # default=str: metadata often carries Paths or enum values from a config; a trace should not
    # fail to save over how one of them prints.
    path.write_text(json.dumps(trace, default=str))
    return path


def bubble_fractions(spans: Spans, makespan: float | None = None) -> dict[int, float]:
    """Idle share of the step per rank: ``1 - busy / makespan``.

    ``busy`` is the length of the union of a rank's compute spans, so spans that overlap (as
    measured timestamps can) are not counted twice.

    Args:
        spans: per rank, (action, start, end); communication actions are skipped.
        makespan: the step time, in the units of spans; default: latest end minus earliest start
            over all ranks.

    Returns:
        per rank in ``spans``, a fraction in [0, 1] (1.0 for a rank with no compute action).

    Raises:
        ValueError: spans hold no compute action, a span ends before it starts, or makespan is
            not positive.
    """
    compute = _compute_spans(spans)
    if makespan is None:
        first, last = _extent(compute)
        makespan = last - first
    if not makespan > 0:
        raise ValueError(f"makespan={makespan} must be positive; the spans have no duration or makespan is wrong")
    out = {}
    for rank, sp in compute.items():
        busy, covered_to = 0.0, float("-inf")
        for start, end in sorted((s, e) for _, s, e in sp):
            if end > covered_to:
                busy += end - max(start, covered_to)
                covered_to = end
        out[rank] = min(1.0, max(0.0, 1.0 - busy / makespan))
    return out


def _local_chunks(sp: list[tuple[Action, float, float]]) -> dict[int, int]:
    """Stage -> its index among the stages this rank runs (ascending), as ScheduleTable.local_chunk."""
    return {stage: i for i, stage in enumerate(sorted({a.stage for a, _, _ in sp}))}


def _chunk_alpha(local: int, n_local: int) -> float:
    if n_local <= 1:
        return 1.0
    return 1.0 - (1.0 - _MIN_CHUNK_ALPHA) * local / (n_local - 1)


def _text_colour(rgba: tuple[float, float, float, float]) -> str:
    # Luminance of the bar as seen on the white background decides black or white digits.
    r, g, b = (rgba[3] * c + (1.0 - rgba[3]) for c in rgba[:3])
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def draw_gantt(
    spans: Spans, path: str | Path, *, title: str = "", time_label: str = "time", makespan: float | None = None
) -> Path:
    """Draw the timeline as a Gantt chart PNG: one row per rank (rank 0 on top), one bar per action.

    Bars are coloured by kind (legend: forward, backward, backward (inputs), backward (weights),
    for the kinds present) and carry their microbatch number when it fits. On a rank that holds
    several stages, later local chunks are drawn lighter. The x axis starts at the earliest start
    (time 0) and spans ``makespan``. The figure widens with the most actions on one rank, up to
    40 inches at 100 dpi.

    Args:
        spans: per rank, (action, start, end); communication actions are skipped.
        path: output PNG file (parents created).
        title: figure title; none when empty.
        time_label: x-axis label, e.g. "time (cost units)" or "time (s)".
        makespan: length of the x axis in the units of spans; default: latest end minus earliest
            start.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: spans hold no compute action, a span ends before it starts, or makespan is
            not positive or shorter than the spans.
    """
    compute = _compute_spans(spans)
    t0, t1 = _extent(compute)
    if makespan is None:
        makespan = t1 - t0
    elif makespan < t1 - t0:
        raise ValueError(f"makespan={makespan} is shorter than the spans ({t1 - t0}); omit it or pass at least that")
    if not makespan > 0:
        raise ValueError(f"makespan={makespan} must be positive; the spans have no duration")

    ranks = list(compute)
    bars: list[tuple[float, float, int, Action, tuple[float, float, float, float]]] = []
    kinds_present: list[str] = []
    max_local = 1
    for row, rank in enumerate(ranks):
        local = _local_chunks(compute[rank])
        max_local = max(max_local, len(local))
        for action, start, end in compute[rank]:
            colour = KIND_STYLE.get(action.kind, (_UNKNOWN_COLOUR, action.kind))[0]
            rgba = to_rgba(colour, _chunk_alpha(local[action.stage], len(local)))
            bars.append((start - t0, end - start, row, action, rgba))
            if action.kind not in kinds_present:
                kinds_present.append(action.kind)
    order = [k for k in KIND_STYLE if k in kinds_present] + [k for k in kinds_present if k not in KIND_STYLE]
    handles = [
        Patch(color=KIND_STYLE.get(k, (_UNKNOWN_COLOUR, k))[0], label=KIND_STYLE.get(k, ("", k))[1]) for k in order
    ]
    if max_local > 1:
        handles += [
            Patch(color=to_rgba(_UNKNOWN_COLOUR, _chunk_alpha(i, max_local)), label=f"local chunk {i}")
            for i in range(max_local)
        ]

    n_actions = max(len(sp) for sp in compute.values())
    width = min(_MAX_WIDTH_IN, max(_MIN_WIDTH_IN, 2.0 + _WIDTH_PER_ACTION_IN * n_actions))
    # The legend sits above the axes and wraps to as many rows as the width needs.
    legend_cols = min(len(handles), max(1, int(width // _LEGEND_ENTRY_IN)))
    legend_rows = -(-len(handles) // legend_cols)
    height = 1.4 + (0.4 if title else 0.0) + 0.3 * legend_rows + _HEIGHT_PER_RANK_IN * len(ranks)
    fig = Figure(figsize=(width, min(_MAX_HEIGHT_IN, height)), dpi=_DPI, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.barh(
        [row for _, _, row, _, _ in bars],
        [dur for _, dur, _, _, _ in bars],
        left=[left for left, _, _, _, _ in bars],
        height=0.8,
        color=[rgba for *_, rgba in bars],
        edgecolor="white",
        linewidth=0.5,
    )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # inverted: rank 0 on top
    ax.set_xlim(0.0, makespan)
    ax.set_xlabel(time_label)
    ax.set_ylabel("pp rank")
    # A figure title, not an axes title: the legend sits where an axes title would, and constrained
    # layout puts a figure title above the axes' decorations.
    if title:
        fig.suptitle(title)
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=legend_cols, frameon=False)

    # Place the microbatch numbers once the layout is final, so bar widths are known in pixels.
    canvas.draw()
    px_per_unit = ax.get_window_extent().width / makespan
    row_px = ax.get_window_extent().height / len(ranks) * 0.8
    widths_px = sorted(dur * px_per_unit for _, dur, _, _, _ in bars)
    typical_px = widths_px[len(widths_px) // 2]
    # Shrink the digits as bars narrow (many bars), within a legible 5..9 pt.
    fontsize = min(9.0, max(5.0, 0.45 * min(typical_px, row_px) * 72 / _DPI))
    char_px = 0.62 * fontsize * _DPI / 72
    for left, dur, row, action, rgba in bars:
        label = str(action.microbatch)
        if dur * px_per_unit >= char_px * len(label) + 2:
            ax.text(
                left + dur / 2,
                row,
                label,
                ha="center",
                va="center",
                fontsize=fontsize,
                color=_text_colour(rgba),
                clip_on=True,
            )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
