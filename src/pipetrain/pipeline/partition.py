"""Cut ``n_layer`` transformer layers into ``pp * vpp`` chunks and place them on pp ranks. Pure.

Loop placement (Megatron's virtual pipeline, Narayanan et al. SC'21, section 2.2): stage s lives on
rank ``s % pp``, so rank r holds stages r, r + pp, r + 2 pp, ... For pp=2, vpp=2, n_layer=6::

    stage   0      1      2      3
    layers  [0,2)  [2,4)  [4,5)  [5,6)
    rank    0      1      0      1

V placement (zero-bubble V, Qi et al. ICLR 2024, section 6): the stages zig-zag over the ranks,
down then back up, so with vpp=2 rank r holds stages r and 2 pp - 1 - r, and rank 0 holds both the
embedding and the head. For pp=2, vpp=2 the ranks of stages 0..3 are 0, 1, 1, 0.

A schedule fixes its placement; a table read from a CSV file carries its own, given as a tuple
(element s = rank of stage s) wherever a placement is accepted.

When ``n_layer`` is not a multiple of the chunk count, the first ``n_layer % (pp * vpp)`` chunks
get one layer more (as InfiniTrain does).
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("loop", "v")

Placement = str | tuple[int, ...]


@dataclass(frozen=True)
class StageInfo:
    """What one pp rank builds and runs.

    Attributes:
        rank: the pp rank, 0..pp-1.
        is_first_stage: the rank holds stage 0 (the embedding).
        is_last_stage: the rank holds the last stage (final norm + LM head, the loss).
        stages: global stage index of each local chunk, in local-chunk order.
        chunk_layer_ranges: global layer range [begin, end) of each local chunk, same order.
    """

    rank: int
    is_first_stage: bool
    is_last_stage: bool
    stages: tuple[int, ...]
    chunk_layer_ranges: tuple[tuple[int, int], ...]


def stage_to_rank(stage: int, *, pp: int, vpp: int, placement: Placement = "loop") -> int:
    """The pp rank that holds global ``stage`` (0..pp*vpp-1) under ``placement``.

    Raises:
        ValueError: unknown placement, a placement tuple of the wrong length, or stage out of range.
    """
    if not 0 <= stage < pp * vpp:
        raise ValueError(f"stage {stage} is out of range for pp={pp}, vpp={vpp}")
    if isinstance(placement, tuple):
        if len(placement) != pp * vpp or not all(0 <= r < pp for r in placement):
            raise ValueError(f"placement {placement} must give a rank in 0..{pp - 1} for each of the {pp * vpp} stages")
        return placement[stage]
    if placement not in PLACEMENTS:
        raise ValueError(f"parallel.placement={placement!r} is not supported; use one of {PLACEMENTS}")
    if placement == "v":
        lap, offset = divmod(stage, pp)
        return offset if lap % 2 == 0 else pp - 1 - offset
    return stage % pp


def placement_table(*, pp: int, vpp: int, placement: Placement = "loop") -> tuple[int, ...]:
    """``rank`` of every stage: element s is the rank holding stage s."""
    return tuple(stage_to_rank(s, pp=pp, vpp=vpp, placement=placement) for s in range(pp * vpp))


def stage_layer_ranges(n_layer: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Global layer range [begin, end) of each stage; the first ``n_layer % num_stages`` get one more.

    Raises:
        ValueError: fewer layers than stages (a stage would hold no transformer layer).
    """
    if num_stages < 1:
        raise ValueError(f"the number of chunks (parallel.pp * parallel.vpp) must be >= 1, got {num_stages}")
    if n_layer < num_stages:
        raise ValueError(
            f"model.n_layer={n_layer} is fewer than the {num_stages} chunks (parallel.pp * parallel.vpp); "
            f"use model.n_layer >= {num_stages} or lower parallel.pp / parallel.vpp"
        )
    base, extra = divmod(n_layer, num_stages)
    ranges, begin = [], 0
    for s in range(num_stages):
        end = begin + base + (1 if s < extra else 0)
        ranges.append((begin, end))
        begin = end
    return tuple(ranges)


def partition(n_layer: int, *, pp: int, vpp: int, placement: Placement = "loop") -> tuple[StageInfo, ...]:
    """Per-rank :class:`StageInfo` for ``n_layer`` layers cut into ``pp * vpp`` chunks.

    Args:
        n_layer: number of transformer layers of the whole model.
        pp: pipeline-parallel degree (ranks).
        vpp: virtual pipeline size (stages per rank).
        placement: "loop" (stage s on rank s % pp), "v" (zig-zag), or a tuple of ranks per stage.

    Returns:
        One StageInfo per rank, index = rank.

    Raises:
        ValueError: pp or vpp below 1, fewer layers than chunks, unknown placement.
    """
    if pp < 1:
        raise ValueError(f"parallel.pp={pp} must be >= 1")
    if vpp < 1:
        raise ValueError(f"parallel.vpp={vpp} must be >= 1")
    num_stages = pp * vpp
    ranges = stage_layer_ranges(n_layer, num_stages)
    ranks = placement_table(pp=pp, vpp=vpp, placement=placement)
    infos = []
    for r in range(pp):
        stages = tuple(s for s in range(num_stages) if ranks[s] == r)
        infos.append(
            StageInfo(
                rank=r,
                is_first_stage=0 in stages,
                is_last_stage=num_stages - 1 in stages,
                stages=stages,
                chunk_layer_ranges=tuple(ranges[s] for s in stages),
            )
        )
    return tuple(infos)
