"""``sweep_summary.csv``: one row per job of a Hydra ``--multirun`` sweep, written at the sweep root.

Registered in conf/train.yaml as a Hydra callback (``hydra.callbacks.sweep_summary``). After
each job it reads every job dir's ``summary.json`` and ``.hydra/overrides.yaml`` and writes a
table: the job number, one column per overridden key (``schedule``, ``parallel.pp``, ...), then
the measured results. A job without a summary (it failed) gets a row with ``status=failed``.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SUMMARY_CSV = "sweep_summary.csv"
# (column, how to read it from a job's summary.json)
RESULTS = (
    ("steps", lambda s: s["steps"]),
    ("world_size", lambda s: s["world_size"]),
    ("final_train_loss", lambda s: s["train_loss"][-1] if s["train_loss"] else None),
    ("val_loss", lambda s: s["val_loss"]),
    ("tokens_per_s", lambda s: s["tokens_per_s"]),
    ("step_time_s", lambda s: s["step_time_s"]),
    ("bubble_measured_mean", lambda s: _mean(s.get("bubble_fraction_measured"))),
    ("bubble_simulated_mean", lambda s: _mean(s.get("bubble_fraction_simulated"))),
    ("skipped_steps", lambda s: s.get("skipped_steps")),
)


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra sweep (``--multirun`` or ``hydra.mode: MULTIRUN``);
    a sweep job's child ranks run in RUN mode."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _mean(values: list[float] | None) -> float | None:
    return statistics.fmean(values) if values else None


def _job_dirs(sweep_dir: Path) -> list[Path]:
    jobs = [d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()]
    return sorted(jobs, key=lambda d: int(d.name))


def _overrides(job_dir: Path) -> dict[str, str]:
    file = job_dir / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return {}
    pairs = [str(item).split("=", 1) for item in OmegaConf.load(file)]
    return {key.lstrip("+~"): value for key, value in (p for p in pairs if len(p) == 2)}


def write_sweep_summary(sweep_dir: Path) -> Path:
    """Write ``sweep_dir/sweep_summary.csv`` from the job dirs ``0``, ``1``, ... and return its path."""
    rows: list[dict[str, Any]] = []
    keys: list[str] = []
    for job_dir in _job_dirs(sweep_dir):
        overrides = _overrides(job_dir)
        keys += [k for k in overrides if k not in keys]
        row: dict[str, Any] = {"job": int(job_dir.name), **overrides}
        summary_file = job_dir / "summary.json"
        if summary_file.is_file():
            summary = json.loads(summary_file.read_text())
            row["status"] = "ok"
            row.update({column: read(summary) for column, read in RESULTS})
        else:
            row["status"] = "failed"
        rows.append(row)
    # Keys every job shares with one value (the sweep's fixed overrides) are left out.
    varying = [k for k in keys if len({row.get(k) for row in rows}) > 1]
    columns = ["job", *varying, "status", *(column for column, _ in RESULTS)]
    out = sweep_dir / SUMMARY_CSV
    partial = sweep_dir / f".{SUMMARY_CSV}.partial"
    with partial.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(partial, out)  # readers never see half a table
    return out


class SweepSummary(Callback):
    """Hydra callback writing :data:`SUMMARY_CSV` at the sweep root after every job of a multirun.

    Rewritten after each job (not only at the end), so the table exists, with the failed jobs
    marked, even when a failed job makes Hydra end the sweep with an error.
    """

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        mode = config.hydra.mode
        if getattr(mode, "name", mode) == "MULTIRUN":  # not in a sweep's child ranks (RUN)
            # After a failed job Hydra may end the sweep without on_multirun_end: say where it is.
            failed = getattr(getattr(job_return, "status", None), "name", None) == "FAILED"
            self._write(Path(config.hydra.sweep.dir), announce=failed)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write(Path(config.hydra.sweep.dir), announce=True)

    @staticmethod
    def _write(sweep_dir: Path, *, announce: bool) -> None:
        if sweep_dir.is_dir():
            out = write_sweep_summary(sweep_dir)
            if announce:
                print(f"pipetrain: sweep summary: {out}")
