"""The schedule CLI: its JSON tables round-trip into tables that pass check() and, simulated with
unit costs (F=1, B=2), give the closed-form bubbles."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from pipetrain.pipeline.check import check
from pipetrain.pipeline.schedules import SCHEDULES, Action, ScheduleTable
from pipetrain.pipeline.simulate import simulate
from pipetrain.schedule import compose_config, render, render_config


def _from_json(doc: dict, name: str) -> ScheduleTable:
    placement = tuple(doc["placement"][str(s)] for s in range(len(doc["placement"])))
    actions = {int(r): tuple(map(Action.parse, acts)) for r, acts in doc["actions"].items()}
    return ScheduleTable(name, doc["pp"], doc["vpp"], doc["num_microbatches"], placement, actions)


def test_cli_json_is_one_object_for_the_documented_command():
    proc = run_cli(
        "pipetrain.schedule",
        ["schedule=interleaved_1f1b", "parallel.pp=4", "parallel.vpp=2", "parallel.num_microbatches=8", "format=json"],
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one JSON object, nothing else on stdout
    assert set(doc) == {"pp", "vpp", "num_microbatches", "placement", "actions"}
    assert (doc["pp"], doc["vpp"], doc["num_microbatches"]) == (4, 2, 8)
    assert doc["placement"] == {str(s): s % 4 for s in range(8)}
    table = _from_json(doc, "interleaved_1f1b")
    check(table)
    assert sum(len(a) for a in table.actions.values()) == 2 * 8 * 8


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_cli_tables_pass_check_over_a_grid(name):
    cfg = compose_config([f"schedule={name}", "format=json", "model.n_layer=32"])
    n_checked = 0
    for pp in range(1, 9):
        for vpp in range(1, 5):
            for m in range(1, 33):
                cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.num_microbatches = pp, vpp, m
                try:
                    out = render_config(cfg)
                except ValueError:
                    continue
                table = _from_json(json.loads(out), name)
                check(table)
                closed_form = None
                if vpp == 1 and name in ("gpipe", "1f1b"):
                    closed_form = (pp - 1) / (m + pp - 1)
                elif name == "interleaved_1f1b" and m % pp == 0:
                    closed_form = (pp - 1) / (vpp * m + pp - 1)
                if closed_form is not None:
                    bubbles = simulate(table, forward=1, backward=2).bubble.values()
                    assert all(b == pytest.approx(closed_form, abs=1e-12) for b in bubbles), (pp, vpp, m)
                n_checked += 1
    # The sizes each schedule documents as accepted, all of them reached through the CLI.
    interleaved = sum(3 * sum(1 for m in range(1, 33) if pp == 1 or m % pp == 0) for pp in range(1, 9))
    documented = {
        "gpipe": 8 * 4 * 32,
        "1f1b": 8 * 32,
        "interleaved_1f1b": interleaved,
        "looped_bfs": 8 * 3 * 32,
        "zb_h1": 8 * 32,
        "zbv": 8 * 32,
        "interleaved_zb": interleaved,
    }
    assert n_checked == documented[name]


def test_cli_text_shows_layout_costs_table_and_grid():
    out = render(["schedule=1f1b", "parallel.pp=2", "parallel.num_microbatches=4", "model.n_layer=5"])
    assert "rank 0: stage 0 layers [0, 3)" in out and "rank 1: stage 1 layers [3, 5)" in out
    # 1F1B, pp=2, m=4, F=1, B=2: makespan 3 * (m + pp - 1) = 15, bubble 1/5.
    assert "makespan 15, bubble rank 0 0.200, rank 1 0.200" in out
    zbv = render(["schedule=zbv", "parallel.pp=2", "parallel.vpp=2", "parallel.num_microbatches=4", "model.n_layer=8"])
    assert "rank 0: stage 0 layers [0, 2), stage 3 layers [6, 8)" in zbv  # the V
    assert "global chunk" in out and "rank 1: " in out


def test_cli_prints_the_table_even_when_the_model_has_too_few_layers_for_a_layout():
    out = render(["schedule=interleaved_1f1b", "parallel.pp=4", "parallel.vpp=2", "parallel.num_microbatches=8"])
    assert "layer layout: model.n_layer=4 is fewer than the 8 chunks" in out
    assert "rank 3 (stages 3, 7)" in out


def test_cli_rejects_added_unknown_keys():
    with pytest.raises(ValueError, match="did you mean parallel.num_microbatches"):
        render(["+parallel.num_microbatch=8"])


def test_cli_csv_round_trips_through_schedule_csv(tmp_path):
    args = ["schedule=zbv", "parallel.pp=2", "parallel.vpp=2", "parallel.num_microbatches=4"]
    text = render([*args, "format=csv"])
    assert text.splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    path = tmp_path / "zbv.csv"
    assert render([*args, "format=csv", f"out={path}"]) == str(path)
    assert path.read_text().rstrip("\n") == text
    back = render(["schedule=csv", f"schedule.path={path}", *args[1:], "format=json"])
    assert json.loads(back)["actions"] == json.loads(render([*args, "format=json"]))["actions"]


def test_cli_png_and_trace_files(tmp_path):
    args = ["schedule=zb_h1", "parallel.pp=4", "parallel.num_microbatches=8"]
    png = render([*args, "format=png", f"out={tmp_path / 'zb.png'}"])
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(open(render([*args, "format=trace", f"out={tmp_path / 'zb.json'}"])).read())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 4 * 8 * 3  # F, I and W of 8 microbatches on 4 ranks
    # simulated with F = I = W = 1 (shown as 1 ms each): makespan 3 m + pp - 1 = 27 ms
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(27_000)
    assert trace["otherData"]["schedule"] == "zb_h1"


def test_cli_compare_prints_simulated_makespan_bubble_and_memory():
    proc = run_cli(
        "pipetrain.schedule",
        ["compare=gpipe,1f1b,interleaved_1f1b,zb_h1", "parallel.pp=4", "parallel.num_microbatches=8"],
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert list(rows) == ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
    # columns: vpp, makespan, max bubble, mean bubble, peak act, peak W stash
    assert rows["1f1b"][1:] == ["1", "33", "0.273", "0.273", "4", "0"]  # 3 (m + pp - 1); 3/11
    assert rows["gpipe"][1:3] == ["1", "33"] and rows["gpipe"][5] == "8"
    assert rows["interleaved_1f1b"][1:4] == ["2", "28.5", "0.158"]  # (pp-1)/(vpp m + pp-1) = 3/19
    assert rows["zb_h1"][1:4] == ["1", "27", "0.111"]  # idle (pp-1)(F+I-W) = 3 of 27


def test_cli_compare_and_costs_errors():
    with pytest.raises(ValueError, match="schedule.name='nope'"):
        render(["compare=1f1b,nope"])
    with pytest.raises(ValueError, match="costs.forward=-1.0 must be >= 0"):
        render(["costs.forward=-1"])
    with pytest.raises(ValueError, match="format='svg' is unknown"):
        render(["format=svg"])
