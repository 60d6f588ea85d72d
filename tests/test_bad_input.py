"""Bad input fails before any process starts: non-zero exit, one line naming the key (or file)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import TINY, run_cli
from pipetrain.data.llmc import write_tokens

CASES = {
    "fewer layers than chunks": (
        ["model.n_layer=3", "parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_1f1b"],
        "model.n_layer=3",
    ),
    "pp below 1": (["parallel.pp=0"], "parallel.pp=0"),
    "vpp below 1": (["parallel.vpp=0"], "parallel.vpp=0"),
    "num_microbatches below 1": (["parallel.num_microbatches=0"], "parallel.num_microbatches=0"),
    "micro_batch_size below 1": (["data.micro_batch_size=0"], "data.micro_batch_size=0"),
    "n_embd not divisible by n_head": (["model.n_embd=30", "model.n_head=4"], "model.n_embd=30"),
    "n_head not divisible by n_kv_head": (["model=llama3", "model.n_head=4", "model.n_kv_head=3"], "model.n_kv_head=3"),
    "unknown schedule name": (["schedule.name=zigzag"], "schedule.name='zigzag'"),
    "unknown schedule option": (["schedule=zigzag"], "schedule"),
    "seq_len above block size": (["data.seq_len=64", "model.block_size=32"], "data.seq_len=64"),
    "1f1b with vpp 2": (["schedule=1f1b", "parallel.vpp=2"], "parallel.vpp=2"),
    "interleaved with m not a multiple of pp": (
        ["schedule=interleaved_1f1b", "parallel.vpp=2", "parallel.num_microbatches=3"],
        "parallel.num_microbatches",
    ),
    "misspelled key": (["parallel.ppp=2"], "parallel.ppp"),
    "added unknown key": (["+parallel.num_microbatch=8"], "did you mean parallel.num_microbatches?"),
    "vocab too small for the data": (["model.vocab_size=100"], "model.vocab_size=100"),
    "fp16 precision": (["trainer.precision=16-mixed"], "trainer.precision='16-mixed'"),
    "negative learning rate": (["optim.lr=-1"], "optim.lr=-1.0"),
    "negative clip": (["optim.grad_clip=-1"], "optim.grad_clip=-1.0"),
    "two nodes from a plain command": (["trainer.num_nodes=2"], "trainer.num_nodes=2"),
    "unknown wandb mode": (["logger=wandb", "logger.mode=bogus"], "logger.mode='bogus'"),
    "odd llama head dim": (["model=llama3", "model.n_embd=120", "model.n_head=8", "model.n_kv_head=4"], "model.n_head"),
    "key of another model family": (["model=gpt2", "model.n_kv_head=2"], "n_kv_head"),
    "llmc without a file": (["data=llmc"], "data.train_bin"),
    "missing data file": (["data=llmc", "data.train_bin=/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
    "zbv with vpp 1": (["schedule=zbv", "parallel.vpp=1"], "parallel.vpp=1 must be 2"),
    "zb_h1 with vpp 2": (["schedule=zb_h1", "parallel.vpp=2"], "parallel.vpp=2 must be 1"),
    "loop placement for zbv": (
        ["schedule=zbv", "parallel.vpp=2", "parallel.placement=loop"],
        "parallel.placement=loop",
    ),
    "csv schedule without a file": (["schedule=csv"], "schedule.path"),
    "csv schedule file missing": (["schedule=csv", "schedule.path=/nonexistent/t.csv"], "/nonexistent/t.csv"),
    "negative timeline period": (["timeline_every_n_steps=-1"], "timeline_every_n_steps=-1"),
}


def _assert_fails_fast(args, expected, tmp_path):
    start = time.monotonic()
    env = {"HYDRA_FULL_ERROR": "0"}  # as a user sees it: the message, not the stack
    proc = run_cli("pipetrain.train", [*TINY, *args, f"hydra.run.dir={tmp_path / 'run'}"], timeout=60, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    # One line says it all: ours ("pipetrain: config error: ...") or Hydra's compose error.
    lines = [ln for ln in proc.stderr.splitlines() if expected in ln]
    assert any(ln.startswith("pipetrain: config error: ") or "Could not" in ln for ln in lines), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 20
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # no process group, no children
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_fails_before_launch(case, tmp_path):
    args, expected = CASES[case]
    _assert_fails_fast(args, expected, tmp_path)


def test_malformed_data_file_names_the_file(tmp_path):
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(b"not a token file" * 100)
    _assert_fails_fast(["data=llmc", f"data.train_bin={bad}"], str(bad), tmp_path)


def test_truncated_data_file_names_the_file(tmp_path):
    good = tmp_path / "tokens.bin"
    write_tokens(good, np.arange(5000) % 256, dtype=np.uint16)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[:3000])
    _assert_fails_fast(["data=llmc", f"data.train_bin={truncated}"], str(truncated), tmp_path)


def test_schedule_cli_rejects_unsupported_sizes():
    proc = run_cli(
        "pipetrain.schedule",
        ["schedule=interleaved_1f1b", "parallel.pp=4", "parallel.vpp=2", "parallel.num_microbatches=6"],
        timeout=60,
    )
    assert proc.returncode == 2
    assert "parallel.num_microbatches" in proc.stderr and proc.stdout == ""


def test_csv_schedule_of_other_sizes_or_broken_names_the_problem(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")  # pp=2, m=2
    _assert_fails_fast(
        ["schedule=csv", f"schedule.path={table}", "parallel.pp=2", "parallel.num_microbatches=4"],
        "parallel.num_microbatches=2",
        tmp_path,
    )
    table.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")  # deadlocks (see the checker's tests)
    _assert_fails_fast(
        ["schedule=csv", f"schedule.path={table}", "parallel.pp=2", "parallel.num_microbatches=2"],
        f"schedule.path={table}: rank 0, step 1, action 0B0: deadlock",
        tmp_path,
    )
