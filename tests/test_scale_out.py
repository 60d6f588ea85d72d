"""Scale out and survive: checkpoints (resume, reshard, atomic saves, refusals), launchers
(torchrun, SLURM's srun), sweeps, dead ranks and non-finite losses, through the real CLI.

Checkpoint numbers: a GPT-2 (tied embedding/head, held on two ranks at pp=2) trains 6 steps at
pp=2 vpp=2 with interleaved 1F1B, saving every 2 steps. Resuming from step 4 must give steps 5
and 6 bit for bit at the same layout, and within 1e-5 at pp=1, pp=4 and dp=2 x pp=2.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, free_port, run_cli, train_run
from pipetrain.checkpoint import find_last, is_complete

TOL = 1e-5
SAVED_AT = ("model=gpt2", "model.n_layer=8", "parallel.num_microbatches=4", "trainer.max_steps=6")
LAYOUT = ("parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_1f1b")


def quoted(path: Path) -> str:
    """A checkpoint path as a Hydra override value: ``step=N`` holds an '=', so quote it."""
    return f'ckpt_path="{path}"'


def processes_of(run_dir: Path) -> list[int]:
    """PIDs of live processes whose command line names ``run_dir`` (every rank of that run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if str(run_dir) in cmdline and "Z (zombie)" not in state and "pipetrain.train" in cmdline:
            pids.append(int(entry.name))
    return pids


def rank_pid(run_dir: Path, global_rank: int) -> int:
    """The pid of ``global_rank`` of a run started by Lightning's launcher on one node."""
    for pid in processes_of(run_dir):
        env = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item
        )
        if int(env.get("LOCAL_RANK", "0")) == global_rank:
            return pid
    raise AssertionError(f"no process of rank {global_rank} under {run_dir}")


def read_checkpoint(path: Path, tmp_path: Path) -> dict:
    """Every tensor of a DCP checkpoint by key (converted with torch's own dcp_to_torch_save)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out)


def start_training(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipetrain.train", *TINY, *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {path} appeared:\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


# ------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The uninterrupted 6-step run at pp=2 vpp=2, checkpointing every 2 steps, keeping 2."""
    run_dir = tmp_path_factory.mktemp("saved")
    summary = train_run(run_dir, *SAVED_AT, *LAYOUT, "checkpoint.every_n_steps=2", "checkpoint.keep_last=2")
    return run_dir, summary


@pytest.mark.slow
def test_checkpoints_every_n_steps_keep_the_last_k(saved_run):
    run_dir, summary = saved_run
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step=4.ckpt", "step=6.ckpt"]  # step 2 was removed once step 6 was complete
    assert all(is_complete(run_dir / "checkpoints" / n) for n in names)
    assert find_last(run_dir) == run_dir / "checkpoints" / "step=6.ckpt"
    assert summary["checkpoints"] == [str(run_dir / "checkpoints" / n) for n in names]


@pytest.mark.slow
def test_resume_is_bitwise_equal_to_the_uninterrupted_run(saved_run, tmp_path):
    run_dir, full = saved_run
    resumed = train_run(tmp_path, *SAVED_AT, *LAYOUT, quoted(run_dir / "checkpoints" / "step=4.ckpt"))
    assert resumed["first_step"] == 4 and resumed["steps"] == 2
    # Same layout, same arithmetic: identical floats, not merely close.
    assert resumed["train_loss"] == full["train_loss"][4:]
    assert resumed["grad_norm"] == full["grad_norm"][4:]


@pytest.mark.slow
def test_resume_with_dropout_continues_every_ranks_random_stream(tmp_path):
    """Dropout 0.1: the masks after a resume are the uninterrupted run's only if each rank's
    generator state is saved and restored, and nothing else draws from it in between."""
    run = ("model=gpt2", "model.n_layer=4", "model.dropout=0.1", "parallel.pp=2", "trainer.max_steps=4")
    full = train_run(tmp_path / "full", *run, "checkpoint.every_n_steps=2")
    resumed = train_run(tmp_path / "resumed", *run, quoted(tmp_path / "full" / "checkpoints" / "step=2.ckpt"))
    assert resumed["train_loss"] == full["train_loss"][2:]
    fresh = train_run(tmp_path / "fresh", *run)  # the same steps from step 0: dropout does draw
    assert fresh["train_loss"] == full["train_loss"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        # ZB-V's rank 0 holds the embedding and the head as one Parameter: saved under the
        # embedding's name only; interleaved 1F1B's last rank reads its head copy from it.
        (
            ("model=gpt2", "parallel.pp=2", "parallel.vpp=2", "schedule=zbv"),
            ("parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_1f1b"),
        ),
        (("model=llama3", "parallel.pp=2", "schedule=1f1b"), ("parallel=pp1",)),
    ],
    ids=["gpt2-zbv-to-interleaved", "llama3-pp2-to-pp1"],
)
def test_checkpoint_of_other_models_and_placements_reshards(tmp_path, saved, loaded):
    run = ("model.n_layer=8", "parallel.num_microbatches=4", "trainer.max_steps=6")
    full = train_run(tmp_path / "full", *run, *saved, "checkpoint.every_n_steps=4")
    model = saved[0]
    resumed = train_run(
        tmp_path / "resumed", *run, model, *loaded, quoted(tmp_path / "full" / "checkpoints" / "step=4.ckpt")
    )
    for got, want in zip(resumed["train_loss"], full["train_loss"][4:], strict=True):
        assert abs(got - want) <= TOL * want


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel=pp1",),
        ("parallel.pp=4", "schedule=1f1b"),
        ("parallel.dp=2", "parallel.pp=2", "schedule=1f1b", "data.micro_batch_size=1"),
    ],
    ids=["pp1", "pp4", "dp2xpp2"],
)
def test_checkpoint_reshards_to_another_layout(saved_run, tmp_path, layout):
    """Saved at pp=2 vpp=2 (GPT-2 head copy on rank 1), loaded with every weight and AdamW moment
    at another layout: the next steps' losses match the uninterrupted run within 1e-5."""
    run_dir, full = saved_run
    resumed = train_run(tmp_path, *SAVED_AT, *layout, quoted(run_dir / "checkpoints" / "step=4.ckpt"))
    assert resumed["first_step"] == 4
    for got, want in zip(resumed["train_loss"], full["train_loss"][4:], strict=True):
        assert abs(got - want) <= TOL * want
    for got, want in zip(resumed["grad_norm"], full["grad_norm"][4:], strict=True):
        assert abs(got - want) <= TOL * want


@pytest.mark.slow
def test_ckpt_path_last_continues_the_run_dir_and_its_wandb_run(tmp_path):
    common = (*SAVED_AT[:3], "parallel.pp=2", "logger=wandb", "checkpoint.every_n_steps=2")
    env = {"WANDB_MODE": "offline"}
    first = run_cli("pipetrain.train", [*TINY, *common, "trainer.max_steps=4", f"hydra.run.dir={tmp_path}"], env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_cli(
        "pipetrain.train",
        [*TINY, *common, "trainer.max_steps=6", "ckpt_path=last", f"hydra.run.dir={tmp_path}"],
        env=env,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_step"] == 4 and summary["steps"] == 2
    assert summary["resumed_from"] == str(tmp_path / "checkpoints" / "step=4.ckpt")
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    assert len({run.name.rsplit("-", 1)[1] for run in runs}) == 1  # one wandb run id, continued


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """A 2-step pp=1 GPT-2 (4 layers) checkpoint, for the refusals."""
    run_dir = tmp_path_factory.mktemp("small")
    train_run(
        run_dir, "model=gpt2", "model.n_layer=4", "parallel=pp1", "trainer.max_steps=2", "checkpoint.every_n_steps=2"
    )
    return run_dir / "checkpoints" / "step=2.ckpt"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ("model=gpt2", "model.n_layer=3"),
            "(4 layers) does not fit model.family=gpt2 model.n_layer=3 model.n_embd=32: unexpected keys: model.layers",
        ),
        (("model=gpt2", "model.n_layer=5"), "missing keys: model.layers.4."),
        (
            ("model=gpt2", "model.n_layer=4", "model.n_embd=64"),
            "shape mismatches: model.embed.wpe.weight (32, 32) vs model (32, 64)",
        ),
        (("model=llama3", "model.n_layer=4"), "missing keys: model.embed.tok_embeddings.weight"),
    ],
    ids=["fewer-layers", "more-layers", "wider", "other-family"],
)
def test_checkpoint_that_does_not_fit_is_refused_before_launch(small_checkpoint, tmp_path, overrides, expected):
    proc = run_cli(
        "pipetrain.train", [*TINY, *overrides, "parallel.pp=2", quoted(small_checkpoint), f"hydra.run.dir={tmp_path}"]
    )
    assert proc.returncode == 2
    assert "pipetrain: config error: checkpoint" in proc.stderr and str(small_checkpoint) in proc.stderr
    assert expected in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_ckpt_path_that_is_not_a_checkpoint_names_the_path(small_checkpoint, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        tmp_path / "nowhere": "no such checkpoint",
        empty: "is not a pipetrain checkpoint",
    }
    for path, expected in cases.items():
        proc = run_cli("pipetrain.train", [*TINY, "parallel=pp1", quoted(path), f"hydra.run.dir={tmp_path / 'run'}"])
        assert proc.returncode == 2 and str(path) in proc.stderr and expected in proc.stderr, proc.stderr[-2000:]
    # A checkpoint dir with a broken file: each is named.
    broken = tmp_path / "step=9.ckpt"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"not a pickle")
    (broken / "trainer_state.pt").write_bytes(b"")
    proc = run_cli("pipetrain.train", [*TINY, "parallel=pp1", quoted(broken), f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and f"{broken}/trainer_state.pt: cannot be read" in proc.stderr, proc.stderr[-2000:]
    shutil.copy(small_checkpoint / "trainer_state.pt", broken / "trainer_state.pt")
    proc = run_cli("pipetrain.train", [*TINY, "parallel=pp1", quoted(broken), f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and f"{broken}/.metadata: cannot be read" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_save_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    """SIGKILL every rank while a save is being written (its .partial dir exists); the previous
    checkpoint stays complete, ``last`` ignores the partial one, and training resumes from it."""
    # A model whose checkpoint takes a while to write (~100 MB with AdamW moments).
    big = ("model.n_layer=4", "model.n_embd=512", "model.n_head=8", "model.vocab_size=4096", "parallel.pp=2")
    for attempt in range(3):
        run_dir = tmp_path / f"attempt{attempt}"
        proc = start_training(run_dir, *big, "trainer.max_steps=1000", "checkpoint.every_n_steps=1")
        partial = run_dir / "checkpoints" / ".step=2.ckpt.partial"
        wait_for(partial, proc)
        ranks = processes_of(run_dir)
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        if partial.exists() and not (run_dir / "checkpoints" / "step=2.ckpt").exists():
            break  # killed mid-write (otherwise the save won the race: try again)
    else:
        pytest.fail("three saves finished before they could be killed")
    assert not processes_of(run_dir)
    assert is_complete(run_dir / "checkpoints" / "step=1.ckpt")
    assert find_last(run_dir) == run_dir / "checkpoints" / "step=1.ckpt"
    resumed = train_run(run_dir, *big, "trainer.max_steps=2", "checkpoint.every_n_steps=1", "ckpt_path=last")
    assert resumed["first_step"] == 1 and resumed["steps"] == 1
    assert resumed["resumed_from"] == str(run_dir / "checkpoints" / "step=1.ckpt")
    assert is_complete(run_dir / "checkpoints" / "step=2.ckpt")  # the next save replaced the partial one


# ------------------------------------------------------------------------------ failures


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "signum"),
    [("rank1", signal.SIGKILL), ("rank0", signal.SIGKILL), ("rank0", signal.SIGTERM)],
    ids=["rank1-kill", "rank0-kill", "rank0-term"],
)
def test_killed_rank_ends_the_job_naming_it_and_leaves_no_process(tmp_path, victim, signum):
    proc = start_training(tmp_path, "parallel.pp=2", "trainer.max_steps=100000", "checkpoint.every_n_steps=5")
    wait_for(tmp_path / "checkpoints" / "step=5.ckpt", proc)
    ranks = processes_of(tmp_path)
    assert len(ranks) == 2 and proc.pid in ranks
    target = proc.pid if victim == "rank0" else next(pid for pid in ranks if pid != proc.pid)
    killed_at = time.monotonic()
    os.kill(target, signum)
    _, stderr = proc.communicate(timeout=90)
    ended_after = time.monotonic() - killed_at
    print(f"{victim} got {signum.name}: the job ended after {ended_after:.2f} s with code {proc.returncode}")
    assert ended_after < 60
    assert proc.returncode != 0
    if victim == "rank1":
        assert "pipetrain: rank 1 (pid" in stderr and "was killed by SIGKILL" in stderr, stderr[-3000:]
    time.sleep(1.0)
    assert not processes_of(tmp_path), "a rank outlived the job"
    if victim != "rank1":
        return
    # The last completed checkpoint loads.
    last = find_last(tmp_path)
    assert last is not None and is_complete(last)
    resumed = train_run(
        tmp_path / "resumed", "parallel.pp=2", f"trainer.max_steps={int(last.stem.split('=')[1]) + 1}", quoted(last)
    )
    assert resumed["steps"] == 1


@pytest.mark.slow
def test_nonfinite_loss_stops_with_the_step_named_and_no_checkpoint_of_it(tmp_path):
    proc = run_cli(
        "pipetrain.train",
        [
            *TINY,
            "parallel.pp=2",
            "trainer.max_steps=6",
            "checkpoint.every_n_steps=1",
            "debug.nonfinite_step=3",
            f"hydra.run.dir={tmp_path}",
        ],
    )
    assert proc.returncode != 0
    assert "non-finite training loss nan / gradient norm nan at step 3" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step=1.ckpt", "step=2.ckpt"]
    assert not processes_of(tmp_path)


@pytest.mark.slow
def test_nonfinite_step_is_skipped_when_asked(tmp_path):
    skip = ("parallel.pp=2", "trainer.max_steps=5", "debug.nonfinite_step=3", "train.skip_nonfinite=true")
    summary = train_run(tmp_path / "skip", *skip, "checkpoint.every_n_steps=1", "checkpoint.keep_last=5")
    assert summary["steps"] == 5 and summary["skipped_steps"] == 1
    losses = summary["train_loss"]
    assert losses[2] is None  # the poisoned step's NaN loss (null in strict JSON) ...
    assert all(isinstance(loss, float) for i, loss in enumerate(losses) if i != 2)  # ... and only that one
    # The skipped step changed no weight and no AdamW moment or step count.
    checkpoints = tmp_path / "skip" / "checkpoints"
    before, after = (read_checkpoint(checkpoints / f"step={n}.ckpt", tmp_path) for n in (2, 3))
    tensors = [k for k in before if k.startswith(("model.", "optim."))]
    assert len(tensors) > 20 and set(tensors) == {k for k in after if k.startswith(("model.", "optim."))}
    assert all((before[k] == after[k]).all() for k in tensors)
    changed = read_checkpoint(checkpoints / "step=4.ckpt", tmp_path)
    assert not (changed["model.embed.wte.weight"] == after["model.embed.wte.weight"]).all()  # step 4 trained


@pytest.mark.slow
def test_hung_rank_fails_the_job_after_the_timeout_naming_it(tmp_path):
    """A rank that stops answering (SIGSTOP) is named once parallel.timeout_s has passed."""
    proc = start_training(
        tmp_path,
        "parallel.dp=2",  # the pp and dp groups get the timeout too, not only the default group
        "parallel.pp=2",
        "parallel.timeout_s=10",
        "trainer.max_steps=100000",
        "checkpoint.every_n_steps=5",
    )
    wait_for(tmp_path / "checkpoints" / "step=5.ckpt", proc)
    child = rank_pid(tmp_path, 1)
    stopped_at = time.monotonic()
    os.kill(child, signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=120)
    ended_after = time.monotonic() - stopped_at
    assert proc.returncode == 1
    assert 10 <= ended_after < 60
    # The ranks waiting on rank 1 say so: for a message (rank 1 named) or in a collective (its
    # group named, which holds rank 1); which one depends on where each was when rank 1 stopped.
    assert re.search(
        r"pipetrain: error: rank \d+( lost rank 1 \(pp rank 1 of replica 0\)|: .* with ranks \[(0, 1|1, 3)\])",
        stderr,
    ), stderr[-3000:]
    assert "parallel.timeout_s=10" in stderr
    time.sleep(1.0)
    assert not processes_of(tmp_path)  # the stopped rank too (killed with rank 0)


# ------------------------------------------------------------------------------ launchers, sweeps


@pytest.mark.slow
def test_a_failed_job_of_a_sweep_leaves_the_others_and_the_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["--multirun", *TINY, "parallel.pp=2", "trainer.max_steps=3", "debug.nonfinite_step=2,null"]
    proc = run_cli("pipetrain.train", [*args, f"hydra.sweep.dir={sweep}"])
    assert proc.returncode != 0  # the sweep reports its failed job ...
    assert "pipetrain: error: non-finite training loss nan / gradient norm nan at step 2" in proc.stderr
    assert (sweep / "1" / "summary.json").exists()  # ... after running the next one
    with (sweep / "sweep_summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["debug.nonfinite_step"], r["status"], r["steps"]) for r in rows] == [
        ("0", "2", "failed", ""),
        ("1", "null", "ok", "3"),
    ]


DP2_PP2 = ("parallel.dp=2", "parallel.pp=2", "trainer.max_steps=4", "model.n_layer=4")


@pytest.fixture(scope="module")
def lightning_dp2_pp2(tmp_path_factory) -> dict:
    """dp=2 x pp=2 started by Lightning's launcher: the reference of the external launchers."""
    return train_run(tmp_path_factory.mktemp("lightning"), *DP2_PP2)


@pytest.mark.slow
def test_torchrun_four_processes_dp2_pp2_equal_the_lightning_launcher(tmp_path, lightning_dp2_pp2):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
    proc = run_cli("pipetrain.train", [*TINY, *DP2_PP2, f"hydra.run.dir={tmp_path}"], launcher=torchrun)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_torchrun = json.loads((tmp_path / "summary.json").read_text())
    assert by_torchrun["world_size"] == lightning_dp2_pp2["world_size"] == 4
    # Same processes, same arithmetic: bitwise equal losses.
    assert by_torchrun["train_loss"] == lightning_dp2_pp2["train_loss"]
    # Rank order: g = dp_rank * pp + pp_rank, printed once at start-up.
    assert "pp groups [[0, 1], [2, 3]], dp groups [[0, 2], [1, 3]]" in proc.stdout


@pytest.mark.slow
def test_lightning_launcher_on_two_nodes_equals_one_node(tmp_path, lightning_dp2_pp2):
    """The same command on two 'nodes' (NODE_RANK 0 and 1, one MASTER_ADDR/PORT), 2 processes each."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "pipetrain.train", *TINY, *DP2_PP2, "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}"]
    nodes = [
        subprocess.Popen(
            cmd + ([] if node == 0 else [f"hydra.job.name=train_node{node}"]),
            env={**base, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert summary["train_loss"] == lightning_dp2_pp2["train_loss"]
    # Each rank logged under its own name: node 1's ranks are 2 and 3.
    assert {p.name for p in tmp_path.glob("*.log")} == {
        "train.log",
        "train_rank1.log",
        "train_node1.log",
        "train_node1_rank3.log",
    }


@pytest.mark.slow
def test_torchrun_two_nodes_with_num_nodes_equal_the_lightning_launcher(tmp_path, lightning_dp2_pp2):
    """Two torchrun agents meeting at one c10d rendezvous, 2 processes each, as on two nodes."""
    port = free_port()
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
    ]  # fmt: skip
    cmd = [*torchrun, "-m", "pipetrain.train", *TINY, *DP2_PP2, "trainer.num_nodes=2"]
    cmd.append(f"hydra.run.dir={tmp_path}/outputs/${{pipetrain_run_name:x}}")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    summary = json.loads((tmp_path / "outputs" / "torchrun-two-nodes" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["config"]["trainer"]["num_nodes"] == 2
    assert summary["train_loss"] == lightning_dp2_pp2["train_loss"]


@pytest.mark.slow
def test_srun_tasks_on_two_nodes_run_through_lightnings_slurm_environment(tmp_path, lightning_dp2_pp2):
    """Four tasks started the way ``srun --nodes 2 --ntasks-per-node 2`` starts them (SLURM_*
    variables, no launcher): Lightning's SLURMEnvironment wires them, and they share the run dir
    slurm-<job id>-<step id>."""
    base = {
        **os.environ,
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NAME": "pipetrain",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [sys.executable, "-m", "pipetrain.train", *TINY, *DP2_PP2, "trainer.num_nodes=2"]
    cmd.append(f"hydra.run.dir={tmp_path}/outputs/${{pipetrain_run_name:x}}")
    tasks = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node)}
        tasks.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [task.communicate(timeout=300) for task in tasks]
    assert [t.returncode for t in tasks] == [0] * 4, "\n".join(err[-2000:] for _, err in outputs)
    summary = json.loads((tmp_path / "outputs" / "slurm-4242-0" / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert summary["train_loss"] == lightning_dp2_pp2["train_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("multirun", ["--multirun", "hydra.mode=MULTIRUN"])
def test_multirun_over_schedules_and_pp_writes_job_dirs_and_a_sweep_summary(tmp_path, multirun):
    """Started with --multirun, or by config (a sweeper setting hydra.mode: MULTIRUN)."""
    sweep = tmp_path / "sweep"
    args = [
        multirun,
        *TINY,
        "trainer.max_steps=3",
        "schedule=gpipe,1f1b",
        "parallel.pp=1,2",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_cli("pipetrain.train", args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(d.name for d in sweep.iterdir() if d.is_dir())
    assert jobs == ["0", "1", "2", "3"]
    with (sweep / "sweep_summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["schedule"], r["parallel.pp"], r["world_size"]) for r in rows] == [
        ("0", "gpipe", "1", "1"),
        ("1", "gpipe", "2", "2"),
        ("2", "1f1b", "1", "1"),
        ("3", "1f1b", "2", "2"),
    ]
    for row in rows:
        summary = json.loads((sweep / row["job"] / "summary.json").read_text())
        assert float(row["final_train_loss"]) == summary["train_loss"][-1]
        assert row["status"] == "ok" and summary["config"]["schedule"]["name"] == row["schedule"]
        assert (sweep / row["job"] / "train.log").exists()
        assert (sweep / row["job"] / "train_rank1.log").exists() == (row["parallel.pp"] == "2")
    # Same seed, same model, every schedule and pp: the same losses.
    finals = {float(r["final_train_loss"]) for r in rows}
    assert max(finals) - min(finals) <= TOL * max(finals)
