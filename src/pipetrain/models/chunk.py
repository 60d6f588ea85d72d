"""The chunk contract shared by every model family: ``TransformerChunk``.

A chunk is a contiguous range of layers, plus the embedding on the first chunk and the final
norm + LM head on the last. A model family subclasses :class:`TransformerChunk` and supplies
``make_embedding``, ``make_block`` and ``make_head`` (and, if its blocks need per-sequence data
such as RoPE tables, ``block_context``); the base class builds only what the chunk owns, names
every parameter globally (``layers.7.attn.c_attn.weight``) and initialises it reproducibly.

Deterministic init independent of the partition: every parameter is drawn from its own random
stream, seeded by ``stream_seed(seed, <global parameter name>)``. Layer l's weights therefore depend
only on (seed, l), the embedding's only on (seed, "embed..."), the head's only on (seed, "head...").
Whether the model is built whole or cut into chunks at any boundaries, a parameter with the same
global name starts with the same values, so a pipelined run starts where the unpipelined one does.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn


def stream_seed(seed: int, key: str) -> int:
    """Seed of the random stream named ``key`` under the run seed ``seed``.

    Stable across processes, machines and Python versions (sha256, not Python's salted ``hash()``),
    so every rank derives the same seed for the same key.

    Args:
        seed: the run seed (``cfg.seed``).
        key: the stream's name, e.g. a global parameter name ``"layers.3.attn.c_attn.weight"``.

    Returns:
        A non-negative 63-bit integer, valid for ``torch.Generator.manual_seed``.
    """
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TransformerChunk(nn.Module):
    """One pipeline chunk: optional embedding, the global layers ``range(*layer_range)``, optional head.

    Submodules:
        embed: the embedding (``has_embedding``) or None.
        layers: ``nn.ModuleDict`` keyed by the global layer index as a string, so parameter names are
            global and a checkpoint saved at one pp loads at another.
        head: final norm + LM head (``has_head``) or None.

    Subclasses set the class attributes below and implement ``make_embedding``, ``make_block`` and
    ``make_head``; they build modules only (the base class initialises every parameter).

    Attributes:
        tied_weights: pairs (embedding-side global name, head-side global name) of parameters that
            must stay equal across ranks. In a chunk holding both sides the head's parameter IS the
            embedding's; a chunk holding only the head initialises it from the embedding-side
            stream, so the separately held copies start equal (keeping their gradients equal is the
            strategy's job).
        residual_projections: module names, relative to a block, of the projections that write
            into the residual stream; their weights use ``init_std / sqrt(2 * n_layer)`` (GPT-2
            paper, section 2.3) so the residual's variance does not grow with depth.
    """

    tied_weights: tuple[tuple[str, str], ...] = ()
    residual_projections: tuple[str, ...] = ()

    def __init__(
        self,
        config: Any,
        *,
        layer_range: tuple[int, int],
        has_embedding: bool,
        has_head: bool,
        seed: int,
        materialize: bool = True,
    ) -> None:
        """Build the chunk's modules on CPU in fp32 and initialise them from ``seed``.

        Args:
            config: the family's model config (a dataclass of ``pipetrain.config`` or the
                equivalent OmegaConf node); must have ``n_layer`` and ``init_std``.
            layer_range: global [begin, end) of the layers this chunk owns.
            has_embedding: whether this chunk is the first stage (owns the embedding).
            has_head: whether this chunk is the last stage (owns the final norm and LM head).
            seed: the run seed; see :func:`stream_seed`.
            materialize: False leaves the parameters on the meta device, uninitialised: names
                and shapes at no cost (what a checkpoint is checked against).

        Raises:
            ValueError: if the layer range is outside ``[0, model.n_layer]``, or is empty while the
                chunk carries neither embedding nor head, or the config is invalid for the family.
        """
        super().__init__()
        begin, end = layer_range
        if not 0 <= begin <= end <= config.n_layer:
            raise ValueError(
                f"layer_range=({begin}, {end}) is not a [begin, end) range inside [0, model.n_layer={config.n_layer}]"
            )
        if begin == end and not (has_embedding or has_head):
            raise ValueError(
                f"layer_range=({begin}, {end}) is empty and the chunk carries neither embedding nor head; "
                f"every middle chunk needs at least one layer: make parallel.pp * parallel.vpp at most "
                f"model.n_layer={config.n_layer}"
            )
        self.validate_config(config)
        self.config = config
        self.layer_range = (begin, end)
        self.has_embedding = has_embedding
        self.has_head = has_head
        self.seed = seed

        # Build on the meta device: no memory, and no draws from the global RNG by the modules'
        # default initialisers. Every parameter is then materialised and drawn from its own stream.
        with torch.device("meta"):
            self.embed = self.make_embedding() if has_embedding else None
            self.layers = nn.ModuleDict({str(layer): self.make_block(layer) for layer in range(begin, end)})
            self.head = self.make_head() if has_head else None
        if materialize:
            self.to_empty(device="cpu")
            self._init_parameters()
        self._tie_weights()

    # ---- hooks supplied by a model family -----------------------------------------------------

    @classmethod
    def validate_config(cls, config: Any) -> None:
        """Raise ValueError, naming the ``model.*`` key, if the config cannot build this family."""

    def make_embedding(self) -> nn.Module:
        """The first stage's embedding: token ids (B, T) int64 -> hidden (B, T, n_embd)."""
        raise NotImplementedError

    def make_block(self, layer_idx: int) -> nn.Module:
        """Global layer ``layer_idx``: called as ``block(h, ctx)``, hidden (B, T, n_embd) -> same."""
        raise NotImplementedError

    def make_head(self) -> nn.Module:
        """The last stage's final norm + LM head: hidden (B, T, n_embd) -> logits (B, T, vocab_size)."""
        raise NotImplementedError

    def block_context(self, h: torch.Tensor) -> Any:
        """Data every block of this forward needs (e.g. RoPE tables for h's length); None if none."""
        return None

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the chunk.

        Args:
            x: token ids (B, T) int64 if the chunk has the embedding, else hidden (B, T, n_embd).

        Returns:
            logits (B, T, vocab_size) if the chunk has the head, else hidden (B, T, n_embd).
        """
        h = self.embed(x) if self.embed is not None else x
        ctx = self.block_context(h)
        for block in self.layers.values():
            h = block(h, ctx)
        return self.head(h) if self.head is not None else h

    # ---- init ---------------------------------------------------------------------------------

    def _is_residual_projection(self, module_name: str) -> bool:
        # module_name is global ("layers.3.attn.c_proj"); strip "layers.<l>." to match the suffixes.
        parts = module_name.split(".")
        return parts[0] == "layers" and ".".join(parts[2:]) in self.residual_projections

    def _init_parameters(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        stream_of = {head_name: embed_name for embed_name, head_name in self.tied_weights}
        with torch.no_grad():
            for module_name, module in self.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    name = f"{module_name}.{param_name}"
                    if isinstance(module, (nn.Linear, nn.Embedding)) and param_name == "weight":
                        generator = torch.Generator().manual_seed(stream_seed(self.seed, stream_of.get(name, name)))
                        module_std = residual_std if self._is_residual_projection(module_name) else std
                        nn.init.normal_(param, mean=0.0, std=module_std, generator=generator)
                    elif isinstance(module, (nn.Linear, nn.LayerNorm, nn.RMSNorm)) and param_name == "bias":
                        nn.init.zeros_(param)
                    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and param_name == "weight":
                        nn.init.ones_(param)
                    else:
                        raise AssertionError(
                            f"no init rule for parameter {name} of {type(module).__name__}; "
                            "add one to TransformerChunk._init_parameters"
                        )

    def _tie_weights(self) -> None:
        for embed_name, head_name in self.tied_weights:
            if self.embed is None or self.head is None:
                continue
            module_name, _, param_name = head_name.rpartition(".")
            setattr(self.get_submodule(module_name), param_name, self.get_parameter(embed_name))
