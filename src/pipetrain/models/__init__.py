"""Model families as pipeline chunks, and ``build_chunk`` to build one from ``cfg.model``.

A new family is a ``TransformerChunk`` subclass plus one entry in :data:`MODEL_FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from pipetrain.models.chunk import TransformerChunk, stream_seed
from pipetrain.models.gpt2 import GPT2Chunk
from pipetrain.models.llama3 import Llama3Chunk, llama3_ffn_hidden_dim

# model.family -> the chunk class that builds it.
MODEL_FAMILIES: dict[str, type[TransformerChunk]] = {
    "gpt2": GPT2Chunk,
    "llama3": Llama3Chunk,
}


def build_chunk(
    config: Any,
    *,
    layer_range: tuple[int, int],
    has_embedding: bool,
    has_head: bool,
    seed: int,
    materialize: bool = True,
) -> TransformerChunk:
    """Build the chunk of ``config.family`` owning the global layers ``range(*layer_range)``.

    Args:
        config: ``cfg.model`` (a ``GPT2Config`` / ``Llama3Config`` or the equivalent OmegaConf node).
        layer_range: global [begin, end) of the layers the chunk owns.
        has_embedding: the chunk is the first stage and owns the embedding.
        has_head: the chunk is the last stage and owns the final norm and LM head.
        seed: the run seed; a parameter's initial value depends only on it and the global name.
        materialize: False builds on the meta device without initialising (names and shapes only).

    Returns:
        The chunk, on CPU in fp32. ``layer_range=(0, n_layer)`` with both flags is the whole model.

    Raises:
        ValueError: if ``model.family`` is not registered, or the chunk's config or range is invalid.
    """
    family = getattr(config, "family", None)
    if family not in MODEL_FAMILIES:
        raise ValueError(f"model.family={family!r} is not a known model family; choose one of {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[family](
        config,
        layer_range=layer_range,
        has_embedding=has_embedding,
        has_head=has_head,
        seed=seed,
        materialize=materialize,
    )


__all__ = [
    "MODEL_FAMILIES",
    "GPT2Chunk",
    "Llama3Chunk",
    "TransformerChunk",
    "build_chunk",
    "llama3_ffn_hidden_dim",
    "stream_seed",
]
