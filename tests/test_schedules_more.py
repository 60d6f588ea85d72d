"""Looped BFS, zero-bubble schedules, V placement, CSV tables and the cost model. No torch."""

from __future__ import annotations

import pytest

from pipetrain.pipeline.check import ScheduleError, check
from pipetrain.pipeline.partition import partition, placement_table
from pipetrain.pipeline.schedules import (
    SCHEDULES,
    build_schedule,
    gpipe_on,
    read_csv_table,
    resolve_placement,
    write_csv_table,
)
from pipetrain.pipeline.simulate import simulate

UNIT = dict(forward=1, backward=2, backward_input=1, backward_weight=1)


def accepted(name, pps=range(1, 9), vpps=range(1, 5), ms=range(1, 25)):
    for pp in pps:
        for vpp in vpps:
            for m in ms:
                try:
                    yield build_schedule(name, pp=pp, vpp=vpp, num_microbatches=m)
                except ValueError:
                    continue


def test_accepted_sizes_of_the_new_schedules():
    grid = {(pp, vpp, m) for pp in range(1, 9) for vpp in range(1, 5) for m in range(1, 25)}
    sizes = {name: {(t.pp, t.vpp, t.num_microbatches) for t in accepted(name)} for name in SCHEDULES}
    assert sizes["looped_bfs"] == {g for g in grid if g[1] >= 2}
    assert sizes["zb_h1"] == {g for g in grid if g[1] == 1}
    assert sizes["zbv"] == {g for g in grid if g[1] == 2}
    assert sizes["interleaved_zb"] == {g for g in grid if g[1] >= 2 and (g[0] == 1 or g[2] % g[0] == 0)}
    with pytest.raises(ValueError, match="parallel.vpp=3 must be 2"):
        build_schedule("zbv", pp=2, vpp=3, num_microbatches=4)
    with pytest.raises(ValueError, match="use schedule=zb_h1"):
        build_schedule("interleaved_zb", pp=2, vpp=1, num_microbatches=4)
    with pytest.raises(ValueError, match="interleaved_zb needs parallel.num_microbatches"):
        build_schedule("interleaved_zb", pp=4, vpp=2, num_microbatches=6)


# ---------------------------------------------------------------------------- closed forms


def test_zb_h1_idles_pp_minus_1_times_f_plus_i_minus_w():
    """Qi et al. 2024, 3.1: (pp-1)(F+I-W) per rank against 1F1B's (pp-1)(F+B); a third at F=I=W."""
    for pp in range(2, 9):
        for m in range(pp, 4 * pp + 1):
            zb = simulate(build_schedule("zb_h1", pp=pp, vpp=1, num_microbatches=m), **UNIT)
            ofob = simulate(build_schedule("1f1b", pp=pp, vpp=1, num_microbatches=m), **UNIT)
            assert zb.idle == dict.fromkeys(range(pp), (pp - 1) * (1 + 1 - 1)), (pp, m)
            assert ofob.idle == dict.fromkeys(range(pp), (pp - 1) * (1 + 2)), (pp, m)
            assert zb.makespan == 3 * m + (pp - 1)


def test_zb_h1_idle_with_unequal_costs():
    # F=2, I=2, W=1: (pp-1)(F+I-W) = 3 (pp-1); 1F1B with B = I + W = 3 idles 5 (pp-1).
    for pp in range(2, 9):
        m = 2 * pp
        costs = dict(forward=2, backward=3, backward_input=2, backward_weight=1)
        zb = simulate(build_schedule("zb_h1", pp=pp, vpp=1, num_microbatches=m), **costs)
        ofob = simulate(build_schedule("1f1b", pp=pp, vpp=1, num_microbatches=m), **costs)
        assert max(zb.idle.values()) == 3 * (pp - 1)
        assert set(ofob.idle.values()) == {5 * (pp - 1)}


def test_interleaved_closed_form_with_split_costs_unchanged():
    for pp in range(2, 9):
        for vpp in (2, 3, 4):
            m = 2 * pp
            sim = simulate(build_schedule("interleaved_1f1b", pp=pp, vpp=vpp, num_microbatches=m), **UNIT)
            for bubble in sim.bubble.values():
                assert bubble == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-12)


def test_looped_bfs_closed_form_when_m_at_least_pp():
    for pp in range(2, 9):
        for vpp in (2, 3, 4):
            for m in range(1, 17):
                sim = simulate(build_schedule("looped_bfs", pp=pp, vpp=vpp, num_microbatches=m), **UNIT)
                closed = (pp - 1) / (vpp * m + pp - 1)
                for bubble in sim.bubble.values():
                    # below pp microbatches a rank's next stage waits for the wrap-around: more bubble
                    assert bubble == pytest.approx(closed, abs=1e-12) if m >= pp else bubble > closed


def test_gpipe_and_1f1b_closed_form_pp_2_to_8():
    for name in ("gpipe", "1f1b"):
        for pp in range(2, 9):
            for m in range(1, 17):
                sim = simulate(build_schedule(name, pp=pp, vpp=1, num_microbatches=m), **UNIT)
                for bubble in sim.bubble.values():
                    assert bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


def test_zero_bubble_schedules_beat_their_full_backward_peers():
    for pp in range(2, 9):
        m = 2 * pp
        ofob = simulate(build_schedule("1f1b", pp=pp, vpp=1, num_microbatches=m), **UNIT).makespan
        inter = simulate(build_schedule("interleaved_1f1b", pp=pp, vpp=2, num_microbatches=m), **UNIT).makespan
        # a vpp=2 stage holds half a rank's layers: halve its costs to compare at equal work
        half = {k: v / 2 for k, v in UNIT.items()}
        zbv = simulate(build_schedule("zbv", pp=pp, vpp=2, num_microbatches=m), **half).makespan
        izb = simulate(build_schedule("interleaved_zb", pp=pp, vpp=2, num_microbatches=m), **UNIT).makespan
        assert simulate(build_schedule("zb_h1", pp=pp, vpp=1, num_microbatches=m), **UNIT).makespan < ofob
        assert zbv < ofob
        assert izb < inter


# ---------------------------------------------------------------------------- memory


def test_peak_memory_of_split_schedules():
    for pp in range(2, 9):
        for m in (pp, 2 * pp):
            ofob = simulate(build_schedule("1f1b", pp=pp, vpp=1, num_microbatches=m))
            zb = simulate(build_schedule("zb_h1", pp=pp, vpp=1, num_microbatches=m))
            # ZB-H1 keeps every rank at 1F1B's worst rank (rank 0: pp microbatches).
            assert max(zb.peak_in_flight.values()) == max(ofob.peak_in_flight.values()) == pp
            # rank r defers r W's: that many I'd-but-not-W'd microbatches, plus the one in hand.
            assert zb.peak_weight_stash == {r: min(r + 1, m) for r in range(pp)}
            assert set(ofob.peak_weight_stash.values()) == {0}
            zbv = simulate(build_schedule("zbv", pp=pp, vpp=2, num_microbatches=m))
            # two half-size stages per rank: 2 pp microbatch-stages = 1F1B's pp microbatches
            assert max(zbv.peak_in_flight.values()) <= 2 * pp


def test_per_stage_costs():
    table = build_schedule("gpipe", pp=2, vpp=1, num_microbatches=2)
    sim = simulate(table, forward=[1, 3], backward=[2, 6])
    # stage 1 is three times slower: rank 1 starts at 1 and is busy 2*3 + 2*6 = 18; rank 0's two
    # backwards wait for it (13 -> 15, 19 -> 21).
    assert sim.makespan == 21
    assert sim.idle == {0: 15, 1: 3}
    with pytest.raises(ValueError, match="forward costs: got 3 values for 2 stages"):
        simulate(table, forward=[1, 2, 3])


def test_comm_latency_adds_per_hop():
    table = build_schedule("gpipe", pp=4, vpp=1, num_microbatches=1)
    base = simulate(table, forward=1, backward=2).makespan
    assert simulate(table, forward=1, backward=2, comm=0.5).makespan == base + 2 * 3 * 0.5


# ---------------------------------------------------------------------------- shapes of the tables


def test_looped_bfs_runs_stages_breadth_first_and_backwards_newest_first():
    table = build_schedule("looped_bfs", pp=2, vpp=2, num_microbatches=3)
    assert [str(a) for a in table.actions[0]] == (
        ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2", "2B2", "2B1", "2B0", "0B2", "0B1", "0B0"]
    )


def test_zbv_rank_holds_a_v_and_the_embedding_with_the_head():
    for pp in range(1, 9):
        table = build_schedule("zbv", pp=pp, vpp=2, num_microbatches=2 * pp)
        for r in range(pp):
            assert {a.stage for a in table.actions[r]} == {r, 2 * pp - 1 - r}
        infos = partition(4 * pp, pp=pp, vpp=2, placement=table.placement)
        assert infos[0].is_first_stage and infos[0].is_last_stage
        assert infos[0].chunk_layer_ranges == ((0, 2), (4 * pp - 2, 4 * pp))
    assert placement_table(pp=3, vpp=3, placement="v") == (0, 1, 2, 2, 1, 0, 0, 1, 2)


def test_zb_h1_table_pp4():
    table = build_schedule("zb_h1", pp=4, vpp=1, num_microbatches=8)
    # rank r warms up like 1F1B (pp - 1 - r forwards) and defers its first r W's.
    assert " ".join(map(str, table.actions[0][:9])) == "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1"
    assert " ".join(map(str, table.actions[1][:8])) == "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4"
    assert " ".join(map(str, table.actions[3][:10])) == "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4"
    assert " ".join(map(str, table.actions[3][-4:])) == "3W4 3W5 3W6 3W7"


def test_gpipe_on_follows_any_placement():
    for name in SCHEDULES:
        for table in list(accepted(name, pps=range(1, 5), vpps=(1, 2), ms=(1, 4)))[::3]:
            evaluation = gpipe_on(table)
            assert evaluation.placement == table.placement
            check(evaluation)


def test_resolve_placement():
    zbv = build_schedule("zbv", pp=2, vpp=2, num_microbatches=4)
    with pytest.raises(ValueError, match=r"parallel.placement='zigzag' is not supported; use one of \('auto'"):
        resolve_placement(zbv, "zigzag")
    assert resolve_placement(zbv, "auto") == (0, 1, 1, 0) == resolve_placement(zbv, "v")
    with pytest.raises(ValueError, match="parallel.placement=loop .* schedule zbv .* use parallel.placement=auto"):
        resolve_placement(zbv, "loop")


# ---------------------------------------------------------------------------- CSV


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_csv_round_trip(tmp_path, name):
    for table in list(accepted(name, pps=(1, 2, 4), vpps=(1, 2), ms=(4, 8))):
        path = write_csv_table(table, tmp_path / "t.csv")
        back = read_csv_table(path)
        assert (back.pp, back.vpp, back.num_microbatches) == (table.pp, table.vpp, table.num_microbatches)
        assert back.placement == table.placement and back.actions == table.actions
        assert path.read_text().splitlines()[0].split(",")[0] == str(table.actions[0][0])


def test_csv_table_through_build_schedule(tmp_path):
    table = build_schedule("zbv", pp=2, vpp=2, num_microbatches=4)
    path = write_csv_table(table, tmp_path / "zbv.csv")
    assert build_schedule("csv", pp=2, vpp=2, num_microbatches=4, path=path).actions == table.actions
    with pytest.raises(ValueError, match=r"holds a table for parallel.num_microbatches=4, .* set parallel.num"):
        build_schedule("csv", pp=2, vpp=2, num_microbatches=8, path=path)
    with pytest.raises(ValueError, match="schedule=csv needs schedule.path"):
        build_schedule("csv", pp=2, vpp=2, num_microbatches=4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the file is empty"),
        ("0F0,0X0\n1F0\n", r"row 1 \(rank 0\) cell 2: cannot parse action '0X0'"),
        ("0F0,0B0,2F0,2B0\n1F0,1B0\n", "3 stages .* cannot be spread evenly over 2 ranks"),
        ("0F0,0B0,3F0,3B0\n1F0,1B0,3F0\n", r"stages \[2\] appear in no row"),
        ("0F0,1F0,2F0,2B0,1B0,0B0\n3F0,3B0\n", r"row 1 \(rank 0\) holds 3 stages, but 4 stages over 2 ranks"),
    ],
)
def test_bad_csv_names_file_and_problem(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"schedule.path={path}: {message}"):
        read_csv_table(path)


def test_csv_missing_file_and_stage_on_two_ranks(tmp_path):
    with pytest.raises(ValueError, match="cannot read the schedule CSV"):
        read_csv_table(tmp_path / "nope.csv")
    path = tmp_path / "two.csv"
    path.write_text("0F0,1F0,1B0,0B0\n1F0,1B0\n")
    with pytest.raises(ScheduleError, match="rank 1, step 0, action 1F0: stage 1 is on rank 0 and also on rank 1"):
        check(read_csv_table(path))
