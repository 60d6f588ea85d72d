"""llm.c / InfiniTrain token files: read, write and check them.

Format (Karpathy's llm.c ``dev/data/data_common.py``, read by InfiniTrain's TinyShakespeareDataset):

    bytes [0, 1024)     header: 256 little-endian int32
                          [0] magic: 20240520 -> uint16 tokens (GPT-2), 20240801 -> uint32 (LLaMA-3)
                          [1] version: llm.c writes 1 for uint16 files and 7 for uint32 files
                          [2] number of tokens N
                          [3:] zero
    bytes [1024, ...)   N little-endian tokens of the dtype the magic names

The token count is an int32, so one file holds fewer than 2**31 tokens; larger corpora are split
into shards. The version is reported but not checked (readers of the format ignore it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

# magic -> (token dtype, version llm.c writes, what writes it)
_FORMATS: dict[int, tuple[np.dtype, int, str]] = {
    20240520: (np.dtype("<u2"), 1, "uint16 tokens, GPT-2"),
    20240801: (np.dtype("<u4"), 7, "uint32 tokens, LLaMA-3"),
}
_KNOWN_MAGICS = ", ".join(f"{magic} ({what})" for magic, (_, _, what) in _FORMATS.items())


class DataFileError(ValueError):
    """A token file is missing or malformed. The message starts with the file's path."""


@dataclass(frozen=True)
class TokenFileInfo:
    """What a valid token file's header says.

    Attributes:
        path: the file.
        dtype: little-endian token dtype, ``<u2`` or ``<u4``.
        num_tokens: N, the number of tokens after the header (>= 1).
        version: header[1], as written (not checked).
    """

    path: Path
    dtype: np.dtype
    num_tokens: int
    version: int

    @property
    def vocab_bound(self) -> int:
        """Exclusive upper bound on token ids the dtype can hold: 2**16 or 2**32."""
        return 2 ** (8 * self.dtype.itemsize)


def check_file(path: str | os.PathLike[str]) -> TokenFileInfo:
    """Validate a token file from its header and size alone (reads 1024 bytes).

    Args:
        path: the token file.

    Returns:
        The header's contents.

    Raises:
        DataFileError: the file is missing or not a regular file, is shorter than the 1024-byte
            header, has an unknown magic, holds a different number of token bytes than the
            header's count says, or holds zero tokens. The message names the file.
    """
    path = Path(path)
    if not path.is_file():
        problem = "is not a regular file" if path.exists() else "does not exist"
        raise DataFileError(f"{path}: token file {problem}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataFileError(
            f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte llm.c header "
            "(truncated, or not a token file)"
        )
    with path.open("rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, num_tokens = (int(x) for x in header[:3])
    if magic not in _FORMATS:
        raise DataFileError(f"{path}: unknown magic number {magic} in the header; known: {_KNOWN_MAGICS}")
    dtype = _FORMATS[magic][0]
    data_bytes = size - HEADER_BYTES
    if num_tokens < 0 or data_bytes != num_tokens * dtype.itemsize:
        raise DataFileError(
            f"{path}: header says {num_tokens} tokens ({num_tokens * dtype.itemsize} bytes of {dtype.name}) "
            f"but the file holds {data_bytes} bytes after the header "
            f"({data_bytes / dtype.itemsize:g} tokens): truncated or corrupt"
        )
    if num_tokens == 0:
        raise DataFileError(f"{path}: file holds zero tokens")
    return TokenFileInfo(path=path, dtype=dtype, num_tokens=num_tokens, version=version)


def read_tokens(path: str | os.PathLike[str]) -> np.ndarray:
    """Map a token file's tokens read-only, without reading them.

    Args:
        path: the token file.

    Returns:
        A read-only ``np.memmap`` of shape (N,) and dtype ``<u2`` or ``<u4`` (the header's).
        Indexing it reads only the pages it touches.

    Raises:
        DataFileError: as :func:`check_file`.
    """
    info = check_file(path)
    return np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.num_tokens,))


def write_tokens(path: str | os.PathLike[str], tokens: npt.ArrayLike, *, dtype: npt.DTypeLike) -> None:
    """Write ``tokens`` as a token file that llm.c, InfiniTrain and :func:`read_tokens` read.

    Args:
        path: the file to create (overwritten if it exists).
        tokens: 1-D non-negative integer token ids, shape (N,), 1 <= N < 2**31.
        dtype: ``np.uint16`` (magic 20240520, version 1) or ``np.uint32`` (magic 20240801,
            version 7), as llm.c writes them.

    Raises:
        ValueError: ``dtype`` is neither, ``tokens`` is not a non-empty 1-D integer array, has
            2**31 or more tokens, or holds an id the dtype cannot represent.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    magic = next((m for m, (dt, _, _) in _FORMATS.items() if dt == dtype), None)
    if magic is None:
        raise ValueError(f"dtype must be uint16 or uint32 (the token types of {_KNOWN_MAGICS}); got {dtype.name}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D integer array; got shape {tokens.shape} of {tokens.dtype}")
    if tokens.size >= 2**31:
        raise ValueError(f"{tokens.size} tokens do not fit the int32 count of one file: split them into shards")
    bound = 2 ** (8 * dtype.itemsize)
    if tokens.min() < 0 or tokens.max() >= bound:
        raise ValueError(
            f"token ids must lie in [0, {bound}) for {dtype.name}; got min {tokens.min()}, max {tokens.max()}"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = magic, _FORMATS[magic][1], tokens.size
    with Path(path).open("wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())
