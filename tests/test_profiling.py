"""Measured-timeline arithmetic, checked on timelines whose answer is known: simulated ones."""

from __future__ import annotations

import json

import pytest

from conftest import train_run
from pipetrain.pipeline.schedules import build_schedule
from pipetrain.pipeline.simulate import simulate
from pipetrain.profiling import PipelineTimeline, comm_latency, mean_costs, measured_bubble, step_spans


def records_from(sim, *, hosts=("node0",), scale_ns=1_000_000, shift_ns=0):
    """What the ranks would gather if they had run exactly the simulated timeline (1 unit = 1 ms)."""
    out = []
    for r, sp in sim.spans.items():
        timings = [(a, shift_ns + int(s * scale_ns), shift_ns + int(e * scale_ns)) for a, s, e in sp]
        out.append(
            {
                "host": hosts[r % len(hosts)],
                "span": (shift_ns, shift_ns + int(sim.makespan * scale_ns)),
                "timings": timings,
            }
        )
    return out


@pytest.mark.parametrize(
    ("name", "pp", "vpp"), [("1f1b", 4, 1), ("zb_h1", 4, 1), ("zbv", 2, 2), ("interleaved_zb", 2, 2)]
)
def test_measured_bubble_of_a_simulated_run_equals_the_simulation(name, pp, vpp):
    table = build_schedule(name, pp=pp, vpp=vpp, num_microbatches=8)
    costs = dict(
        forward=[1.0 + 0.5 * s for s in range(table.num_stages)], backward=3.0, backward_input=1.5, backward_weight=1.0
    )
    sim = simulate(table, **costs, comm=0.25)
    spans, wall = step_spans(records_from(sim, shift_ns=5_000_000_000))
    assert wall == pytest.approx(sim.makespan / 1000)
    for r, b in measured_bubble(spans, wall).items():
        assert b == pytest.approx(sim.bubble[r], abs=1e-9)
    # Mean costs recovered from the timeline, fed back to the simulator, predict the same bubbles.
    measured = mean_costs([spans], table.num_stages)
    assert measured["F"] == pytest.approx([c / 1000 for c in costs["forward"]])
    comm = comm_latency([spans], table)
    assert comm == pytest.approx(0.25 / 1000)
    again = simulate(
        table,
        forward=measured["F"],
        backward=measured["B"],
        backward_input=measured["I"],
        backward_weight=measured["W"],
        comm=comm,
    )
    for r in sim.bubble:
        assert again.bubble[r] == pytest.approx(sim.bubble[r], abs=1e-9)


def test_ranks_on_different_hosts_are_measured_against_their_own_clock():
    table = build_schedule("gpipe", pp=2, vpp=1, num_microbatches=2)
    sim = simulate(table)
    records = records_from(sim, hosts=("a", "b"))
    far = 10**12  # rank 1's clock reads something unrelated to rank 0's
    records[1] = {
        **records[1],
        "span": (far, far + 1),
        "timings": [(a, s + far, e + far) for a, s, e in records[1]["timings"]],
    }
    spans, wall = step_spans(records)
    assert spans[1] == [(a, pytest.approx(s / 1000), pytest.approx(e / 1000)) for a, s, e in sim.spans[1]]
    assert wall == pytest.approx(sim.makespan / 1000)


def test_callback_records_every_n_steps_after_warmup_and_the_last():
    cb = PipelineTimeline(every_n_steps=10, run_dir=".", max_steps=35, warmup_steps=10)
    assert [s for s in range(1, 36) if cb._due(s)] == [20, 30, 35]
    off = PipelineTimeline(every_n_steps=0, run_dir=".", max_steps=35)
    assert not any(off._due(s) for s in range(1, 36))
    assert off.summary() == {}


@pytest.mark.slow
def test_training_writes_timeline_files_consistent_with_summary(tmp_path):
    summary = train_run(
        tmp_path,
        "model.n_layer=4",
        "schedule=zb_h1",
        "parallel.pp=2",
        "parallel.num_microbatches=4",
        "trainer.max_steps=4",
        "timeline_every_n_steps=2",
        "timing_warmup_steps=1",
    )
    assert summary["timeline_steps"] == [2, 4]
    measured, simulated = summary["bubble_fraction_measured"], summary["bubble_fraction_simulated"]
    assert len(measured) == len(simulated) == 2
    assert all(0.0 <= b < 1.0 for b in measured + simulated)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    table = build_schedule("zb_h1", pp=2, vpp=1, num_microbatches=4)
    # every action of the last step, on the rank that ran it (tid = pp rank)
    assert sorted((e["tid"], e["name"]) for e in events) == sorted(
        (r, str(a)) for r, acts in table.actions.items() for a in acts
    )
    # the trace's own numbers give back the step-4 measured bubble
    wall = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    for r in (0, 1):
        busy = sum(e["dur"] for e in events if e["tid"] == r)
        assert trace["otherData"]["bubble_measured"][str(r)] == pytest.approx(1 - busy / wall, abs=1e-6)
    assert trace["otherData"]["step"] == 4
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
