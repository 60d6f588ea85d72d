"""Timeline export: Chrome trace events, Gantt PNGs and bubble fractions on hand-built spans. No torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from pipetrain.pipeline.schedules import Action
from pipetrain.pipeline.timeline import (
    KIND_STYLE,
    bubble_fractions,
    chrome_trace,
    draw_gantt,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spans(table):
    """{rank: [("0F0", start, end), ...]} -> spans with Actions (comm kinds written as e.g. "0SEND_F0")."""
    out = {}
    for rank, rows in table.items():
        out[rank] = []
        for text, start, end in rows:
            stage, kind, mb = int(text[0]), text[1:-1], int(text[-1])
            out[rank].append((Action(stage, kind, mb), start, end))
    return out


# pp=2, m=2, 1F1B with F=1, B=2: step time 9, each rank busy 6.
ONE_F_ONE_B = _spans(
    {
        0: [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)],
        1: [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)],
    }
)

# pp=2 with V placement (rank 0: stages 0 and 3, rank 1: stages 1 and 2), one microbatch, split
# backward. Rank 0 busy 6 of 10; rank 1 busy 5 (its W halves take 0.5). Holds one zero-width send.
ZERO_BUBBLE = _spans(
    {
        0: [
            ("0F0", 0, 1),
            ("0SEND_F0", 1, 1),
            ("3F0", 3, 4),
            ("3I0", 4, 5),
            ("0I0", 7, 8),
            ("3W0", 8, 9),
            ("0W0", 9, 10),
        ],
        1: [("1F0", 1, 2), ("2F0", 2, 3), ("2I0", 5, 6), ("1I0", 6, 7), ("2W0", 7, 7.5), ("1W0", 7.5, 8)],
    }
)


def _sequential(n_actions, n_ranks=1):
    return {r: [(Action(r, "F", i), float(i), i + 1.0) for i in range(n_actions)] for r in range(n_ranks)}


def _has_colour(image, hex_colour, tol=2.5 / 255):
    return bool((np.abs(image[..., :3] - np.array(to_rgb(hex_colour))).max(axis=-1) < tol).any())


# ---------------------------------------------------------------------------- chrome trace


@pytest.mark.parametrize("spans", [ONE_F_ONE_B, ZERO_BUBBLE], ids=["1f1b", "zero_bubble"])
def test_every_compute_span_is_one_complete_event(spans):
    trace = chrome_trace(spans, time_scale_us=1000.0)
    got = sorted(
        (e["tid"], e["name"], e["cat"], e["ts"], e["dur"], e["pid"], tuple(sorted(e["args"].items())))
        for e in trace["traceEvents"]
        if e["ph"] == "X"
    )
    want = sorted(
        (
            rank,
            str(a),
            a.kind,
            s * 1000.0,
            (e - s) * 1000.0,
            0,
            (("kind", a.kind), ("microbatch", a.microbatch), ("stage", a.stage)),
        )
        for rank, sp in spans.items()
        for a, s, e in sp
        if not a.kind.startswith(("SEND", "RECV"))
    )
    assert got == want
    assert len(got) == sum(len(sp) for sp in spans.values()) - (1 if spans is ZERO_BUBBLE else 0)


def test_trace_names_and_sorts_rows_by_rank_and_keeps_metadata():
    trace = chrome_trace(ONE_F_ONE_B, name="1f1b pp=2", metadata={"schedule": "1f1b", "pp": 2})
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    process = [e["args"]["name"] for e in meta if e["name"] == "process_name"]
    assert names == {0: "rank 0", 1: "rank 1"}
    assert order == {0: 0, 1: 1}
    assert process == ["1f1b pp=2"]
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"] == {"schedule": "1f1b", "pp": 2}
    assert chrome_trace(ONE_F_ONE_B)["otherData"] == {}


def test_write_chrome_trace_round_trips(tmp_path):
    path = write_chrome_trace(ZERO_BUBBLE, tmp_path / "sub" / "trace.json", time_scale_us=1e6, metadata={"m": 1})
    assert path == tmp_path / "sub" / "trace.json"
    loaded = json.loads(path.read_text())
    assert loaded == chrome_trace(ZERO_BUBBLE, time_scale_us=1e6, metadata={"m": 1})
    assert max(e["ts"] + e["dur"] for e in loaded["traceEvents"] if e["ph"] == "X") == 10e6


def test_nonpositive_time_scale_is_rejected():
    with pytest.raises(ValueError, match="time_scale_us"):
        chrome_trace(ONE_F_ONE_B, time_scale_us=0.0)


# ---------------------------------------------------------------------------- gantt


def test_gantt_writes_a_png_that_widens_with_more_actions(tmp_path):
    few = draw_gantt(_sequential(4, n_ranks=2), tmp_path / "few.png", title="few")
    many = draw_gantt(_sequential(40, n_ranks=2), tmp_path / "many.png", title="many")
    capped = draw_gantt(_sequential(200), tmp_path / "capped.png")
    for path in (few, many, capped):
        assert path.read_bytes()[:8] == PNG_MAGIC
    h_few, w_few, _ = imread(few).shape
    h_many, w_many, _ = imread(many).shape
    assert (w_few, w_many) == (600, 1600)  # 6 in minimum; 2 + 0.35 * 40 in; at 100 dpi
    assert h_few == h_many
    assert imread(capped).shape[1] == 4000  # capped at 40 in


def test_gantt_grows_taller_with_more_ranks(tmp_path):
    two = imread(draw_gantt(_sequential(4, n_ranks=2), tmp_path / "two.png")).shape[0]
    eight = imread(draw_gantt(_sequential(4, n_ranks=8), tmp_path / "eight.png")).shape[0]
    assert eight > two


def test_gantt_colours_bars_by_kind(tmp_path):
    one_f_one_b = imread(draw_gantt(ONE_F_ONE_B, tmp_path / "1f1b.png", time_label="time (cost units)"))
    zero_bubble = imread(draw_gantt(ZERO_BUBBLE, tmp_path / "zb.png", makespan=12.0))
    assert _has_colour(one_f_one_b, KIND_STYLE["F"][0]) and _has_colour(one_f_one_b, KIND_STYLE["B"][0])
    assert not _has_colour(one_f_one_b, KIND_STYLE["I"][0])
    assert not _has_colour(one_f_one_b, KIND_STYLE["W"][0])
    for kind in ("F", "I", "W"):
        assert _has_colour(zero_bubble, KIND_STYLE[kind][0]), kind
    assert not _has_colour(zero_bubble, KIND_STYLE["B"][0])


def test_gantt_rejects_a_makespan_shorter_than_the_spans(tmp_path):
    with pytest.raises(ValueError, match="makespan"):
        draw_gantt(ONE_F_ONE_B, tmp_path / "x.png", makespan=8.0)
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------- bubbles


def test_bubble_fractions_match_hand_counts():
    assert bubble_fractions(ONE_F_ONE_B) == pytest.approx({0: 3 / 9, 1: 3 / 9})
    assert bubble_fractions(ONE_F_ONE_B, makespan=12.0) == pytest.approx({0: 6 / 12, 1: 6 / 12})
    assert bubble_fractions(ZERO_BUBBLE) == pytest.approx({0: 4 / 10, 1: 5 / 10})


def test_bubble_fractions_measure_from_the_earliest_start_and_merge_overlaps():
    # Measured clocks do not start at 0, and timestamps of adjacent actions can overlap.
    spans = _spans({0: [("0F0", 100.0, 102.0), ("0F1", 101.0, 103.0)], 1: [("1F0", 102.0, 104.0)], 2: []})
    assert bubble_fractions(spans) == pytest.approx({0: 1 / 4, 1: 2 / 4, 2: 1.0})


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "spans",
    [{}, {0: [], 1: []}, _spans({0: [("0SEND_F0", 1, 1), ("0RECV_B0", 2, 2)]})],
    ids=["no_ranks", "no_actions", "only_comm"],
)
def test_empty_spans_are_rejected_everywhere(spans, tmp_path):
    with pytest.raises(ValueError, match="spans is empty"):
        draw_gantt(spans, tmp_path / "empty.png")
    with pytest.raises(ValueError, match="spans is empty"):
        chrome_trace(spans)
    with pytest.raises(ValueError, match="spans is empty"):
        bubble_fractions(spans)
    assert not (tmp_path / "empty.png").exists()


def test_span_ending_before_it_starts_names_the_action():
    with pytest.raises(ValueError, match="1B0 on rank 1"):
        chrome_trace(_spans({0: [("0F0", 0, 1)], 1: [("1B0", 3, 2)]}))
