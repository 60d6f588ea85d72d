"""Partition, schedules, check and simulation: exhaustive grids against closed forms. No torch."""

from __future__ import annotations

import pytest

from pipetrain.pipeline.check import ScheduleError, check, lockstep
from pipetrain.pipeline.partition import partition, stage_layer_ranges
from pipetrain.pipeline.render import render_grid, render_table
from pipetrain.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleTable,
    build_schedule,
    interleaved_1f1b,
)
from pipetrain.pipeline.simulate import simulate

GRID = [(pp, vpp, m) for pp in range(1, 9) for vpp in range(1, 5) for m in range(1, 33)]


def _accepted(name):
    for pp, vpp, m in GRID:
        try:
            yield build_schedule(name, pp=pp, vpp=vpp, num_microbatches=m)
        except ValueError:
            continue


# ---------------------------------------------------------------------------- partition


def test_partition_uneven_split_gives_first_chunks_one_more_layer():
    infos = partition(7, pp=2, vpp=2)
    # 7 layers in 4 chunks: 2, 2, 2, 1; stage s on rank s % 2.
    assert infos[0].stages == (0, 2) and infos[1].stages == (1, 3)
    assert infos[0].chunk_layer_ranges == ((0, 2), (4, 6))
    assert infos[1].chunk_layer_ranges == ((2, 4), (6, 7))
    assert infos[0].is_first_stage and not infos[0].is_last_stage
    assert infos[1].is_last_stage and not infos[1].is_first_stage


@pytest.mark.parametrize("n_layer", range(1, 25))
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_partition_covers_every_layer_once(n_layer, pp, vpp):
    if n_layer < pp * vpp:
        with pytest.raises(ValueError, match="model.n_layer"):
            partition(n_layer, pp=pp, vpp=vpp)
        return
    infos = partition(n_layer, pp=pp, vpp=vpp)
    by_stage = {s: rng for info in infos for s, rng in zip(info.stages, info.chunk_layer_ranges, strict=True)}
    assert sorted(by_stage) == list(range(pp * vpp))
    layers = [layer for s in sorted(by_stage) for layer in range(*by_stage[s])]
    assert layers == list(range(n_layer))
    sizes = [e - b for b, e in (by_stage[s] for s in sorted(by_stage))]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert sum(i.is_first_stage for i in infos) == 1 and sum(i.is_last_stage for i in infos) == 1


def test_partition_rejects_bad_sizes():
    with pytest.raises(ValueError, match="parallel.pp=0"):
        partition(4, pp=0, vpp=1)
    with pytest.raises(ValueError, match="parallel.vpp=0"):
        partition(4, pp=2, vpp=0)
    with pytest.raises(ValueError, match="parallel.placement"):
        partition(4, pp=2, vpp=1, placement="zigzag")
    with pytest.raises(ValueError, match="must give a rank"):
        partition(4, pp=2, vpp=1, placement=(0, 2))
    assert stage_layer_ranges(5, 2) == ((0, 3), (3, 5))


# ---------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_accepted_table_passes_check(name):
    tables = list(_accepted(name))
    assert tables, f"{name} accepted no size in the grid"
    for table in tables:
        check(table)


def test_accepted_sizes_are_what_the_docs_say():
    accepted = {name: {(t.pp, t.vpp, t.num_microbatches) for t in _accepted(name)} for name in SCHEDULES}
    assert accepted["gpipe"] == set(GRID)
    assert accepted["1f1b"] == {g for g in GRID if g[1] == 1}
    assert accepted["interleaved_1f1b"] == {g for g in GRID if g[1] >= 2 and (g[0] == 1 or g[2] % g[0] == 0)}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_unit_cost_bubble_matches_closed_form_vpp1(name):
    for pp in range(1, 9):
        for m in range(1, 33):
            sim = simulate(build_schedule(name, pp=pp, vpp=1, num_microbatches=m), forward=1, backward=2)
            assert sim.makespan == 3 * (m + pp - 1)
            for bubble in sim.bubble.values():
                assert bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


def test_unit_cost_bubble_matches_closed_form_interleaved():
    n = 0
    for table in _accepted("interleaved_1f1b"):
        pp, vpp, m = table.pp, table.vpp, table.num_microbatches
        if m % pp:
            continue
        sim = simulate(table, forward=1, backward=2)
        for bubble in sim.bubble.values():
            assert bubble == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-12)
        n += 1
    assert n == 255  # every accepted (pp, vpp, m) of the grid with m % pp == 0


def test_1f1b_keeps_min_m_pp_minus_r_in_flight():
    for pp in range(1, 9):
        for m in range(1, 33):
            sim = simulate(build_schedule("1f1b", pp=pp, vpp=1, num_microbatches=m))
            assert sim.peak_in_flight == {r: min(m, pp - r) for r in range(pp)}
            gpipe = simulate(build_schedule("gpipe", pp=pp, vpp=1, num_microbatches=m))
            assert gpipe.peak_in_flight == dict.fromkeys(range(pp), m)


def test_1f1b_table_pp4_m8_rank0_and_rank3():
    table = build_schedule("1f1b", pp=4, vpp=1, num_microbatches=8)
    assert [str(a) for a in table.actions[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert [str(a) for a in table.actions[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]


def test_interleaved_matches_megatron_warmup_counts():
    pp, vpp, m = 4, 2, 8
    table = build_schedule("interleaved_1f1b", pp=pp, vpp=vpp, num_microbatches=m)
    for r, acts in table.actions.items():
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == min(m * vpp, (pp - r - 1) * 2 + (vpp - 1) * pp) + 1
    # rank 0 visits stage 0 for microbatches 0..3 before stage 4 (groups of pp).
    assert [str(a) for a in table.actions[0][:8]] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3"]


def test_interleaved_groups_would_deadlock_when_m_not_multiple_of_pp():
    """Why build_schedule rejects such m: the same generator produces a table that deadlocks."""
    from pipetrain.pipeline.partition import placement_table

    acts = interleaved_1f1b(4, 3, 5)
    table = ScheduleTable(
        "interleaved_1f1b", 4, 3, 5, placement_table(pp=4, vpp=3), {r: tuple(a) for r, a in acts.items()}
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        check(table)
    with pytest.raises(ValueError, match="parallel.num_microbatches"):
        build_schedule("interleaved_1f1b", pp=4, vpp=3, num_microbatches=5)


def test_build_schedule_errors_name_the_key():
    with pytest.raises(ValueError, match="schedule.name='zigzag'"):
        build_schedule("zigzag", pp=2, vpp=1, num_microbatches=4)
    with pytest.raises(ValueError, match="parallel.vpp=2"):
        build_schedule("1f1b", pp=2, vpp=2, num_microbatches=4)
    with pytest.raises(ValueError, match="parallel.num_microbatches=0"):
        build_schedule("gpipe", pp=2, vpp=1, num_microbatches=0)
    with pytest.raises(ValueError, match="parallel.vpp >= 2"):
        build_schedule("interleaved_1f1b", pp=2, vpp=1, num_microbatches=4)


# ---------------------------------------------------------------------------- check


def _table(actions, pp=2, vpp=1, m=2):
    from pipetrain.pipeline.partition import placement_table

    return ScheduleTable(
        "test",
        pp,
        vpp,
        m,
        placement_table(pp=pp, vpp=vpp),
        {r: tuple(map(Action.parse, a)) for r, a in actions.items()},
    )


GOOD = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
GOOD_SPLIT = {0: ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"], 1: ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]}

# One broken table of each kind, and the start of the error it must raise (rank, step, action).
BROKEN = {
    "missing action": (
        {0: GOOD[0], 1: ["1F0", "1B0", "1F1"]},
        "rank 1, action 1B1: missing backward of stage 1 microbatch 1",
    ),
    "missing W": (
        {0: GOOD_SPLIT[0], 1: ["1F0", "1I0", "1F1", "1I1", "1W0"]},
        "rank 1, action 1W1: missing: 1I1 needs its W",
    ),
    "duplicate action": ({0: ["0F0", "0F1", "0F1", "0B0", "0B1"], 1: GOOD[1]}, "rank 0, step 2, action 0F1: duplicate"),
    "B before its F": ({0: GOOD[0], 1: ["1B0", "1F0", "1F1", "1B1"]}, "rank 1, step 0, action 1B0: runs before 1F0"),
    "I before its F": (
        {0: GOOD_SPLIT[0], 1: ["1I0", "1F0", "1F1", "1I1", "1W0", "1W1"]},
        "rank 1, step 0, action 1I0: runs before 1F0",
    ),
    "W before its I": (
        {0: GOOD_SPLIT[0], 1: ["1F0", "1W0", "1I0", "1F1", "1I1", "1W1"]},
        "rank 1, step 1, action 1W0: runs before 1I0",
    ),
    "stage on two ranks": (
        {0: GOOD[0] + ["1F0"], 1: GOOD[1]},
        "rank 0, step 4, action 1F0: stage 1 is on rank 1 and also",
    ),
    "B and I/W mixed": (
        {0: GOOD[0], 1: ["1F0", "1B0", "1I0", "1W0", "1F1", "1B1"]},
        "rank 1, action 1B0: stage 1 microbatch 0 has a full backward 1B0 and also I/W",
    ),
    # rank 0 waits for microbatch 0's gradient before it sends microbatch 1's activation, while
    # rank 1 waits for that activation before it sends the gradient.
    "cross-rank deadlock": (
        {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]},
        "rank 0, step 1, action 0B0: deadlock",
    ),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_check_rejects_each_broken_kind_naming_rank_step_action(kind):
    check(_table(GOOD))
    check(_table(GOOD_SPLIT))
    actions, message = BROKEN[kind]
    with pytest.raises(ScheduleError) as err:
        check(_table(actions))
    assert str(err.value).startswith(message), str(err.value)


def test_deadlock_error_lists_every_blocked_rank():
    with pytest.raises(ScheduleError) as err:
        check(_table(BROKEN["cross-rank deadlock"][0]))
    text = str(err.value)
    assert "rank 0 step 1 0B0 waits for the input gradient of stage 1 microbatch 0 from rank 1" in text
    assert "rank 1 step 1 1F1 waits for the activation of stage 0 microbatch 1 from rank 0" in text
    assert err.value.rank == 0 and err.value.step == 1 and str(err.value.action) == "0B0"


LOWERED_GOOD = {
    0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
    1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
}


def test_check_accepts_lowered_tables_and_what_lower_emits():
    check(_table(LOWERED_GOOD))
    from pipetrain.pipeline.check import lower

    assert {r: [str(a) for a in acts] for r, acts in lower(_table(GOOD)).items()} == LOWERED_GOOD
    for name in SCHEDULES:
        for table in list(_accepted(name))[::40]:
            lowered = ScheduleTable(name, table.pp, table.vpp, table.num_microbatches, table.placement, lower(table))
            check(lowered)  # the checker accepts every action type it emits


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda a: {0: a[0], 1: [x for x in a[1] if x != "1RECV_F1"]},
            "rank 1, action 1RECV_F1: missing communication",
        ),
        (
            lambda a: {0: ["0SEND_F0", *[x for x in a[0] if x != "0SEND_F0"]], 1: a[1]},
            "rank 0, step 0, action 0SEND_F0",
        ),
        (
            lambda a: {0: a[0] + ["0SEND_B0"], 1: a[1]},
            "rank 0, step 8, action 0SEND_B0: communication action not needed",
        ),
        (lambda a: {0: a[0] + ["0SEND_F1"], 1: a[1]}, "rank 0, step 8, action 0SEND_F1: duplicate action"),
    ],
    ids=["missing RECV", "SEND before its data", "SEND that crosses no rank", "SEND listed twice"],
)
def test_check_rejects_broken_lowered_tables(edit, message):
    with pytest.raises(ScheduleError) as err:
        check(_table(edit(LOWERED_GOOD)))
    assert str(err.value).startswith(message), str(err.value)


def test_receives_out_of_send_order_pass_and_are_listed():
    """Tags (gloo) or the executor's in-order receive (NCCL) deliver the right message."""
    from pipetrain.pipeline.check import messages

    actions = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F1", "1F0", "1B0", "1B1"]}
    check(_table(actions))
    sent, received = messages(_table(actions))[(0, 1)]
    assert sent == [("activation", 0, 0), ("activation", 0, 1)]
    assert received == [("activation", 0, 1), ("activation", 0, 0)]


def test_lockstep_of_gpipe_pp2():
    table = build_schedule("gpipe", pp=2, vpp=1, num_microbatches=2)
    steps = {r: [(t, str(a)) for t, a in tl] for r, tl in lockstep(table).items()}
    assert steps[0] == [(0, "0F0"), (1, "0F1"), (4, "0B0"), (5, "0B1")]
    assert steps[1] == [(1, "1F0"), (2, "1F1"), (3, "1B0"), (4, "1B1")]


def test_action_parse_round_trip_and_errors():
    for text in ("0F0", "12B31", "3F7"):
        assert str(Action.parse(text)) == text
    for bad in ("F0", "0X0", "0F", "a"):
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)


# ---------------------------------------------------------------------------- render


def test_render_table_rows_and_grid():
    table = build_schedule("interleaved_1f1b", pp=2, vpp=2, num_microbatches=2)
    text = render_table(table)
    assert "step" in text and "global chunk" in text and "local chunk" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == sum(len(a) for a in table.actions.values())
    # rank 0's step 2 is 2F0: stage 2 is rank 0's local chunk 1.
    rank0 = rows[: len(table.actions[0])]
    assert rank0[2] == ["2", "F", "0", "2", "1", "2"]
    grid = render_grid(table).splitlines()
    assert grid[1].startswith("rank 0:") and grid[1].split()[2] == "0F0"
    assert len(grid) == 3
