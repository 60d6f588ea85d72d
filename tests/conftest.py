"""Helpers to run the training CLI in a subprocess and read what it wrote.

Multi-process tests never start a multi-process Trainer inside pytest (Lightning's launcher would
re-run pytest in the children): they run ``python -m pipetrain.train`` as a user would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# A model small enough that a 4-process run takes seconds on two cores.
TINY = [
    "model.n_embd=32",
    "model.n_head=4",
    "model.block_size=32",
    "data.seq_len=16",
    "data.micro_batch_size=2",
    "trainer.val_check_interval=0",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
    "logger=none",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    # Checkpoints only where a test asks for them.
    "checkpoint.every_n_steps=0",
]


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (for MASTER_PORT or a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(module: str, args: list[str], *, timeout: float = 240, env: dict | None = None, launcher=None):
    """Run ``python -m module args`` (or ``launcher + [-m, module] + args``); return the CompletedProcess."""
    cmd = (launcher or [sys.executable]) + ["-m", module, *args]
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def train_run(run_dir: Path, *overrides: str, launcher=None) -> dict:
    """Train with ``overrides`` into ``run_dir``; return summary.json (fails the test on error)."""
    proc = run_cli("pipetrain.train", [*TINY, *overrides, f"hydra.run.dir={run_dir}"], launcher=launcher)
    if proc.returncode != 0:
        pytest.fail(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def load_rank_files(run_dir: Path, prefix: str) -> dict[int, dict[str, torch.Tensor]]:
    """``{rank: {global name: tensor}}`` from the ``<prefix>_rank<r>.pt`` files of a run."""
    return {int(p.stem.rsplit("rank", 1)[1]): torch.load(p) for p in sorted(run_dir.glob(f"{prefix}_rank*.pt"))}


def merged(per_rank: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for tensors in per_rank.values():
        out.update(tensors)
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
