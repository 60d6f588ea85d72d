"""Tokens/s and bubbles of every schedule at pp=2 against pp=1 on the same model, side by side.

    python benchmarks/throughput.py [--steps 60] [--rounds 2] [extra overrides ...]

Each round runs every layout once through the training CLI, in turn, so that machine noise
spreads over all of them; the table gives the median over rounds of each run's median
tokens/s (summary.json, after warm-up), its ratio to pp=1, and per rank the measured bubble
against the one the cost model predicts from the measured action costs (summary.json's
bubble_fraction_measured / _simulated, last round), with the largest gap in percentage points.
Every process uses one CPU thread (trainer.cpu_threads_per_process=1), so pp=2 uses two cores
where pp=1 uses one, and dp=2 x pp=2 four (on a two-core machine they share the two cores).
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
    "pp=2 gpipe": ["parallel.pp=2", "parallel.vpp=1", "schedule=gpipe"],
    "pp=2 1f1b": ["parallel.pp=2", "parallel.vpp=1", "schedule=1f1b"],
    "pp=2 zb_h1": ["parallel.pp=2", "parallel.vpp=1", "schedule=zb_h1"],
    "pp=2 vpp=2 interleaved": ["parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_1f1b"],
    "pp=2 vpp=2 looped_bfs": ["parallel.pp=2", "parallel.vpp=2", "schedule=looped_bfs"],
    "pp=2 vpp=2 zbv": ["parallel.pp=2", "parallel.vpp=2", "schedule=zbv"],
    "pp=2 vpp=2 interleaved_zb": ["parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_zb"],
    # Two replicas of the pp=2 1F1B pipeline: 4 processes, twice the tokens per step.
    "dp=2 pp=2 1f1b": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1", "schedule=1f1b"],
}


def run_once(overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "pipetrain.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all); pp=1 always runs")
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
        f"timeline_every_n_steps={max(1, args.steps // 4)}",
        *args.overrides,
    ]
    layouts = {n: v for n, v in LAYOUTS.items() if n == "pp=1" or not args.only or n in args.only}
    results: dict[str, list[float]] = {name: [] for name in layouts}
    bubbles: dict[str, tuple[list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, layout in layouts.items():
                run_dir = Path(tmp) / f"round{r}-{name.replace('=', '').replace(' ', '_')}"
                summary = run_once(common + layout, run_dir)
                results[name].append(summary["tokens_per_s"])
                bubbles[name] = (summary["bubble_fraction_measured"], summary["bubble_fraction_simulated"])
    base = statistics.median(results["pp=1"])
    print(
        f"{'layout':<28}{'tokens/s':>9}{'vs pp=1':>8}  {'bubble measured':>16}  {'simulated':>12}  {'gap pp':>6}   runs"
    )
    for name, values in results.items():
        med = statistics.median(values)
        measured, simulated = bubbles[name]
        gap = max(abs(a - b) for a, b in zip(measured, simulated, strict=True)) * 100
        print(
            f"{name:<28}{med:>9.0f}{med / base:>8.2f}  {'/'.join(f'{b:.3f}' for b in measured):>16}  "
            f"{'/'.join(f'{b:.3f}' for b in simulated):>12}  {gap:>6.1f}   {', '.join(f'{v:.0f}' for v in values)}"
        )


if __name__ == "__main__":
    main()
