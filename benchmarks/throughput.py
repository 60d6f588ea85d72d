"""Tokens/s of pp=1 vs pp=2 (1F1B) vs pp=2 x vpp=2 (interleaved 1F1B) on the same model, side by side.

    python benchmarks/throughput.py [--steps 60] [--rounds 2] [extra overrides ...]

Each round runs every layout once through the training CLI, in turn, so that machine noise
spreads over all of them; the table gives the median over rounds of each run's median
tokens/s (summary.json, after warm-up) and its ratio to pp=1. Every process uses one CPU thread
(trainer.cpu_threads_per_process=1), so pp=2 uses two cores where pp=1 uses one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "pp=1": ["parallel.pp=1", "parallel.vpp=1", "schedule=1f1b"],
    "pp=2 1f1b": ["parallel.pp=2", "parallel.vpp=1", "schedule=1f1b"],
    "pp=2 vpp=2 interleaved": ["parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_1f1b"],
}


def run_once(overrides: list[str], run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "pipetrain.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    common = [
        "model.n_layer=8",
        "parallel.num_microbatches=4",
        f"trainer.max_steps={args.steps}",
        "trainer.val_check_interval=0",
        "trainer.enable_progress_bar=false",
        "trainer.accelerator=cpu",
        "trainer.cpu_threads_per_process=1",
        "logger=none",
        *args.overrides,
    ]
    results: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, layout in LAYOUTS.items():
                run_dir = Path(tmp) / f"round{r}-{name.replace('=', '').replace(' ', '_')}"
                results[name].append(run_once(common + layout, run_dir))
    base = statistics.median(results["pp=1"])
    print(f"{'layout':<26}{'tokens/s (median)':>20}{'ratio to pp=1':>16}   runs")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<26}{med:>20.0f}{med / base:>16.2f}   {', '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
