"""Our task tables against torch.distributed.pipelining's own, for the same (pp, vpp, m).

torch builds its orders without processes in ``_schedule_visualizer.get_schedule_ops`` (it mocks
the stages). We compare the compute actions (F, B, I, W) per rank, in order. Torch also emits
``REDUCE_GRAD`` (its data-parallel hook) and ``None`` idle slots; neither is a compute action.

Known differences, each asserted below so that a change on either side shows up:

- torch's 1F1B (``Schedule1F1B``, torch 2.13) builds a malformed table for its last rank: the
  forwards are numbered from 1 and run to m (``1F1, 1B0, 1F2, 1B1`` for pp=2, m=2), so microbatch
  0 never gets a forward there and microbatch m, which does not exist, does. Our checker rejects
  that table; ours runs ``1F0, 1B0, 1F1, 1B1``. Every other rank matches exactly.
- torch's 1F1B rejects m < pp; ours runs it (warm-up shortened to m).
"""

from __future__ import annotations

import csv
import logging

import pytest

from pipetrain.pipeline.check import ScheduleError, check
from pipetrain.pipeline.partition import placement_table
from pipetrain.pipeline.schedules import Action, ScheduleTable, build_schedule, read_csv_table

visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")

# ours -> (torch's schedule class name, vpp values to compare)
PAIRS = {
    "gpipe": ("GPipe", [1]),
    "1f1b": ("1F1B", [1]),
    "interleaved_1f1b": ("Interleaved1F1B", [2, 3]),
    "looped_bfs": ("LoopedBFS", [2, 3]),
    "zbv": ("ZBVZeroBubble", [2]),
    "interleaved_zb": ("InterleavedZeroBubble", [2, 3]),
}
SIZES = [(pp, m) for pp in range(2, 6) for m in range(1, 13)]


def torch_orders(cls: str, pp: int, vpp: int, m: int, *, with_comms: bool = False) -> list[list[str]]:
    logging.disable(logging.WARNING)  # torch logs every bubble it inserts
    try:
        ops = visualizer.get_schedule_ops(cls, pp, m, num_stages_per_rank=vpp, with_comms=with_comms)
    finally:
        logging.disable(logging.NOTSET)
    return [[str(a) for a in rank if a is not None] for rank in ops]


def compute_only(row: list[str]) -> list[str]:
    return [text for text in row if "REDUCE_GRAD" not in text and Action.parse(text).is_compute]


@pytest.mark.parametrize("ours", sorted(PAIRS))
def test_same_actions_in_the_same_order_as_torch(ours):
    cls, vpps = PAIRS[ours]
    compared, differences = 0, []
    for pp, m in SIZES:
        for vpp in vpps:
            try:
                table = build_schedule(ours, pp=pp, vpp=vpp, num_microbatches=m)
            except ValueError:
                continue
            if ours == "1f1b" and m < pp:
                with pytest.raises(ValueError, match="microbatches"):
                    torch_orders(cls, pp, vpp, m)
                continue
            theirs = torch_orders(cls, pp, vpp, m)
            compared += 1
            for rank in range(pp):
                mine = [str(a) for a in table.actions[rank]]
                if compute_only(theirs[rank]) != mine:
                    differences.append((pp, vpp, m, rank, mine, compute_only(theirs[rank])))
    assert compared >= 30
    if ours != "1f1b":
        assert differences == []
        return
    # The one known difference: torch's last rank numbers its forwards from 1 (see module doc).
    assert differences and all(rank == pp - 1 for pp, _, _, rank, _, _ in differences)
    for pp, _, m, _, mine, theirs in differences:
        shifted = [
            str(Action(a.stage, a.kind, a.microbatch + 1)) if a.kind == "F" else str(a) for a in map(Action.parse, mine)
        ]
        assert theirs == shifted, (pp, m)


def test_torch_1f1b_last_rank_table_fails_our_check():
    theirs = torch_orders("1F1B", 2, 1, 2)
    table = ScheduleTable(
        "torch_1f1b",
        2,
        1,
        2,
        placement_table(pp=2, vpp=1),
        {r: tuple(Action.parse(t) for t in compute_only(row)) for r, row in enumerate(theirs)},
    )
    # its last rank runs 1F1, 1B0, 1F2, 1B1: microbatch 2 does not exist (and 1F0 never runs)
    with pytest.raises(ScheduleError, match=r"rank 1, step 2, action 1F2: action out of range"):
        check(table)


@pytest.mark.parametrize("cls, vpp", [("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2)])
@pytest.mark.parametrize("with_comms", [False, True], ids=["compute_only", "compute_comms"])
def test_checker_accepts_csv_exported_by_torch(tmp_path, cls, vpp, with_comms):
    """A CSV as torch's ``_dump_csv`` writes it (rows of actions, idle slots as empty cells)."""
    pp, m = 4, 8
    ops = visualizer.get_schedule_ops(cls, pp, m, num_stages_per_rank=vpp, with_comms=with_comms)
    path = tmp_path / "torch.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        for rank in ops:
            writer.writerow(["" if a is None else str(a) for a in rank])
    table = read_csv_table(path)
    assert (table.pp, table.vpp, table.num_microbatches) == (pp, vpp, m)
    check(table)
    if with_comms:
        assert any(a.kind.startswith("SEND") for a in table.actions[0])
    ours_name = {
        "Interleaved1F1B": "interleaved_1f1b",
        "ZBVZeroBubble": "zbv",
        "InterleavedZeroBubble": "interleaved_zb",
    }
    ours = build_schedule(ours_name[cls], pp=pp, vpp=vpp, num_microbatches=m)
    assert table.placement == ours.placement
    for rank in range(pp):
        assert table.compute_actions(rank) == ours.actions[rank]
