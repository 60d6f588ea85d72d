"""Cut ``n_layer`` transformer layers into ``pp * vpp`` chunks and place them on pp ranks. Pure.

Loop placement (Megatron's virtual pipeline, Narayanan et al. SC'21, section 2.2): stage s lives on
rank ``s % pp``, so rank r holds stages r, r + pp, r + 2 pp, ... For pp=2, vpp=2, n_layer=6::

    stage   0      1      2      3
    layers  [0,2)  [2,4)  [4,5)  [5,6)
    rank    0      1      0      1

When ``n_layer`` is not a multiple of the chunk count, the first ``n_layer % (pp * vpp)`` chunks
get one layer more (as InfiniTrain does).
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("loop",)


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


def stage_to_rank(stage: int, *, pp: int, vpp: int, placement: str = "loop") -> int:
    """The pp rank that holds global ``stage`` (0..pp*vpp-1) under ``placement``.

    Raises:
        ValueError: unknown placement or stage out of range.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"parallel.placement={placement!r} is not supported; use one of {PLACEMENTS}")
    if not 0 <= stage < pp * vpp:
        raise ValueError(f"stage {stage} is out of range for pp={pp}, vpp={vpp}")
    return stage % pp


def placement_table(*, pp: int, vpp: int, placement: str = "loop") -> tuple[int, ...]:
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


def partition(n_layer: int, *, pp: int, vpp: int, placement: str = "loop") -> tuple[StageInfo, ...]:
    """Per-rank :class:`StageInfo` for ``n_layer`` layers cut into ``pp * vpp`` chunks.

    Args:
        n_layer: number of transformer layers of the whole model.
        pp: pipeline-parallel degree (ranks).
        vpp: virtual pipeline size (stages per rank).
        placement: stage placement; "loop" puts stage s on rank s % pp.

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
