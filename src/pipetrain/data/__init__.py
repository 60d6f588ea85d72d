"""Data: the Shakespeare corpus, llm.c token files, and the deterministic, dp-sharded batches."""

from pipetrain.data.corpus import ByteTokenizer, shakespeare_text
from pipetrain.data.datamodule import SOURCES, TokenDataModule, TokenSplits, load_splits, validate_data
from pipetrain.data.llmc import DataFileError, TokenFileInfo, check_file, read_tokens, write_tokens

__all__ = [
    "SOURCES",
    "ByteTokenizer",
    "DataFileError",
    "TokenDataModule",
    "TokenFileInfo",
    "TokenSplits",
    "check_file",
    "load_splits",
    "read_tokens",
    "shakespeare_text",
    "validate_data",
    "write_tokens",
]
