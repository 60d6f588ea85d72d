"""Every schedule and layout equals the unpipelined model: losses, gradients, weights (fp32, CPU, gloo).

Each case trains 4 optimizer steps through the real CLI (Lightning's launcher, one process per
pp rank) and compares with a pp=1 run of the same seed: per-step losses, every gradient after
step 1 (by global parameter name) and every weight after the last step, within 1e-5 relative.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import load_rank_files, merged, relative_error, train_run
from pipetrain.pipeline.partition import partition
from pipetrain.pipeline.schedules import build_schedule

pytestmark = pytest.mark.slow

STEPS = 4
TOL = 1e-5
# Weights after several AdamW steps get a looser bound: Adam divides by sqrt(v), so float
# reordering noise in gradients that are zero in exact arithmetic (GPT-2's key bias: softmax is
# invariant to it) becomes an update of its own. Losses and gradients keep the 1e-5 bound.
TOL_WEIGHTS = 1e-4
COMMON = (
    "parallel.num_microbatches=4",
    f"trainer.max_steps={STEPS}",
    "debug.dump_grads_step=1",
    "debug.dump_params=true",
)

# (schedule, pp, vpp, n_layer); n_layer 7 is not a multiple of pp * vpp: an uneven split.
CASES = [
    ("gpipe", 2, 1, 8),
    ("gpipe", 4, 1, 8),
    ("1f1b", 2, 1, 8),
    ("1f1b", 4, 1, 8),
    ("interleaved_1f1b", 2, 2, 8),
    ("interleaved_1f1b", 2, 3, 8),
    ("interleaved_1f1b", 4, 2, 8),
    ("interleaved_1f1b", 2, 2, 7),
    # pp=1 with vpp=2: both stages on one rank, messages between them stay local.
    ("interleaved_1f1b", 1, 2, 8),
    ("gpipe", 1, 2, 7),
    ("1f1b", 4, 1, 7),
    # Split backward (I then W) and the V placement.
    ("looped_bfs", 2, 2, 8),
    ("zb_h1", 2, 1, 8),
    ("zb_h1", 4, 1, 8),
    ("zb_h1", 1, 1, 8),
    ("zbv", 2, 2, 8),
    ("zbv", 4, 2, 8),
    ("zbv", 2, 2, 7),
    ("interleaved_zb", 2, 2, 8),
    ("interleaved_zb", 4, 2, 8),
]

_REFERENCES: dict = {}


def _reference(tmp_path_factory, model: str, n_layer: int, *extra: str):
    key = (model, n_layer, extra)
    if key not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp(f"ref-{model}-{n_layer}")
        summary = train_run(
            run_dir, f"model={model}", f"model.n_layer={n_layer}", "parallel=pp1", "schedule=1f1b", *COMMON, *extra
        )
        grads = merged(load_rank_files(run_dir, "grads"))
        params = merged(load_rank_files(run_dir, "params"))
        _REFERENCES[key] = (summary, grads, params)
    return _REFERENCES[key]


def _layers_of(names) -> set[int]:
    return {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}


def _assert_close_by_name(got: dict, ref: dict, what: str, tol: float = TOL) -> None:
    # A GPT-2 head-side copy of the tied weight (pp > 1) must equal the reference's embedding.
    aliases = {"head.lm_head.weight": "embed.wte.weight"}
    names = {aliases.get(n, n) if n not in ref else n for n in got}
    assert names == set(ref), f"{what}: parameter names differ: {sorted(names ^ set(ref))}"
    for name, tensor in got.items():
        ref_name = name if name in ref else aliases[name]
        err = relative_error(tensor, ref[ref_name])
        assert err <= tol, f"{what} {name}: relative error {err:.2e} > {tol}"


@pytest.mark.parametrize("model", ["gpt2", "llama3"])
@pytest.mark.parametrize(("schedule", "pp", "vpp", "n_layer"), CASES)
def test_pipeline_equals_unpipelined(tmp_path, tmp_path_factory, model, schedule, pp, vpp, n_layer):
    ref_summary, ref_grads, ref_params = _reference(tmp_path_factory, model, n_layer, "optim.grad_clip=null")
    summary = train_run(
        tmp_path,
        f"model={model}",
        f"model.n_layer={n_layer}",
        f"schedule={schedule}",
        f"parallel.pp={pp}",
        f"parallel.vpp={vpp}",
        *COMMON,
        "optim.grad_clip=null",
    )
    assert summary["world_size"] == pp
    losses, ref_losses = summary["train_loss"], ref_summary["train_loss"]
    assert len(losses) == len(ref_losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= TOL * abs(want), f"step {step}: loss {got} vs unpipelined {want}"
    assert losses[-1] < losses[0]  # it trains

    grads = load_rank_files(tmp_path, "grads")
    params = load_rank_files(tmp_path, "params")
    assert sorted(grads) == sorted(params) == list(range(pp))
    # Each rank holds exactly the layers its StageInfo assigns (the schedule's placement: loop or V).
    placement = build_schedule(schedule, pp=pp, vpp=vpp, num_microbatches=4).placement
    for info in partition(n_layer, pp=pp, vpp=vpp, placement=placement):
        expected = {layer for begin, end in info.chunk_layer_ranges for layer in range(begin, end)}
        assert _layers_of(params[info.rank]) == expected
    _assert_close_by_name(merged(grads), ref_grads, "gradient after step 1")
    _assert_close_by_name(merged(params), ref_params, f"weight after step {STEPS}", TOL_WEIGHTS)

    first, last = placement[0], placement[-1]
    if model == "gpt2" and first != last:
        # Tied embedding/head: held on two ranks, the copies must stay bit-identical.
        assert "head.lm_head.weight" in params[last] and "embed.wte.weight" in params[first]
        assert (params[first]["embed.wte.weight"] == params[last]["head.lm_head.weight"]).all()
    elif model == "gpt2":
        # One rank holds both ends (pp=1, or ZB-V's rank 0): one shared Parameter, no head copy.
        assert "head.lm_head.weight" not in params[first]


@pytest.mark.parametrize(
    ("model", "schedule", "vpp"),
    [
        ("gpt2", "1f1b", 1),
        ("llama3", "1f1b", 1),
        ("gpt2", "interleaved_1f1b", 2),
        ("llama3", "interleaved_1f1b", 2),
        # Split backward (the dp all-reduce starts after a W) and V placement (rank 0 holds the
        # embedding and the head as one Parameter).
        ("gpt2", "zbv", 2),
    ],
)
def test_data_parallel_pipeline_equals_unpipelined(tmp_path, tmp_path_factory, model, schedule, vpp):
    """dp=2 x pp=2 (4 processes) on the same global batch as pp=1 dp=1 (8 sequences a step):
    each replica takes micro_batch_size=1, the reference 2. Clipped at 0.05, so the global norm
    over stages and replicas decides every step."""
    clip = "optim.grad_clip=0.05"
    ref_summary, ref_grads, ref_params = _reference(tmp_path_factory, model, 8, clip)
    summary = train_run(
        tmp_path,
        f"model={model}",
        "model.n_layer=8",
        f"schedule={schedule}",
        "parallel.dp=2",
        "parallel.pp=2",
        f"parallel.vpp={vpp}",
        "data.micro_batch_size=1",
        *COMMON,
        clip,
    )
    assert summary["world_size"] == 4
    assert len(summary["train_loss"]) == len(summary["grad_norm"]) == STEPS
    for step, (got, want) in enumerate(zip(summary["train_loss"], ref_summary["train_loss"], strict=True)):
        assert abs(got - want) <= TOL * want, f"loss at step {step}: {got} vs unpipelined {want}"
    # The first step's norm (one norm over both stages, after the dp average) to 1e-5. Later
    # norms see weights after AdamW steps, which amplify reordering noise (TOL_WEIGHTS above);
    # llama3's step-3 norm spikes to 12 and differs by 9e-5 relative.
    norms, ref_norms = summary["grad_norm"], ref_summary["grad_norm"]
    assert abs(norms[0] - ref_norms[0]) <= TOL * ref_norms[0]
    for step, (got, want) in enumerate(zip(norms, ref_norms, strict=True)):
        assert abs(got - want) <= 10 * TOL_WEIGHTS * want, f"grad norm at step {step}: {got} vs unpipelined {want}"
    assert min(norms) > 0.05  # every step clipped
    grads = load_rank_files(tmp_path, "grads")
    params = load_rank_files(tmp_path, "params")
    assert sorted(grads) == sorted(params) == [0, 1, 2, 3]
    # Global rank = dp_rank * pp + pp_rank: ranks 0, 1 are replica 0 and 2, 3 replica 1. After the
    # all-reduce both replicas hold bit-identical gradients and weights.
    for pp_rank in (0, 1):
        for per_rank in (grads, params):
            a, b = per_rank[pp_rank], per_rank[2 + pp_rank]
            assert a.keys() == b.keys() and all((a[n] == b[n]).all() for n in a)
    _assert_close_by_name(merged({r: grads[r] for r in (0, 1)}), ref_grads, "gradient after step 1")
    _assert_close_by_name(merged({r: params[r] for r in (0, 1)}), ref_params, f"weight after step {STEPS}", TOL_WEIGHTS)


@pytest.mark.parametrize("model", ["gpt2", "llama3"])
def test_clipped_steps_equal_unpipelined(tmp_path, tmp_path_factory, model):
    clip = "optim.grad_clip=0.05"
    ref_summary, _, ref_params = _reference(tmp_path_factory, model, 8, clip)
    summary = train_run(tmp_path, f"model={model}", "model.n_layer=8", "schedule=1f1b", "parallel.pp=2", *COMMON, clip)
    # The global norm (one norm over all stages) is what the unpipelined model measures ...
    for got, want in zip(summary["grad_norm"], ref_summary["grad_norm"], strict=True):
        assert abs(got - want) <= TOL * want
    # ... and it is above the threshold at every step, so every step is really clipped.
    assert min(summary["grad_norm"]) > 0.05
    for got, want in zip(summary["train_loss"], ref_summary["train_loss"], strict=True):
        assert abs(got - want) <= TOL * want
    params = load_rank_files(tmp_path, "params")
    _assert_close_by_name(merged(params), ref_params, "clipped weight", TOL_WEIGHTS)
    if model == "gpt2":  # the head-side copy is clipped with the same coefficient as the embedding
        assert (params[0]["embed.wte.weight"] == params[1]["head.lm_head.weight"]).all()


def test_csv_table_exported_by_torch_trains_like_unpipelined(tmp_path, tmp_path_factory):
    """torch's own InterleavedZeroBubble order (as its CSV export holds it, idle slots as empty
    cells) runs in pipetrain's executor and gives the unpipelined losses and gradients."""
    import csv
    import logging

    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    logging.disable(logging.WARNING)
    try:
        ops = visualizer.get_schedule_ops("InterleavedZeroBubble", 2, 4, num_stages_per_rank=2)
    finally:
        logging.disable(logging.NOTSET)
    path = tmp_path / "torch_izb.csv"
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows([["" if a is None else str(a) for a in rank] for rank in ops])
    ref_summary, ref_grads, _ = _reference(tmp_path_factory, "gpt2", 8, "optim.grad_clip=null")
    run_dir = tmp_path / "run"
    summary = train_run(
        run_dir,
        "model=gpt2",
        "model.n_layer=8",
        "schedule=csv",
        f"schedule.path={path}",
        "parallel.pp=2",
        "parallel.vpp=2",
        *COMMON,
        "optim.grad_clip=null",
    )
    for got, want in zip(summary["train_loss"], ref_summary["train_loss"], strict=True):
        assert abs(got - want) <= TOL * abs(want)
    _assert_close_by_name(merged(load_rank_files(run_dir, "grads")), ref_grads, "gradient after step 1")
    assert (run_dir / "schedule.txt").read_text().startswith("schedule=csv pp=2 vpp=2 num_microbatches=4")


def test_torchrun_gives_the_losses_of_the_lightning_launcher(tmp_path):
    import sys

    args = (
        "model=gpt2",
        "model.n_layer=4",
        "schedule=1f1b",
        "parallel.pp=2",
        "parallel.num_microbatches=4",
        "trainer.max_steps=4",
    )
    by_lightning = train_run(tmp_path / "lightning", *args)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    by_torchrun = train_run(tmp_path / "torchrun", *args, launcher=torchrun)
    assert by_torchrun["world_size"] == by_lightning["world_size"] == 2
    # Same processes, same arithmetic: the losses are bitwise equal, not merely close.
    assert by_torchrun["train_loss"] == by_lightning["train_loss"]
    assert by_lightning["train_loss"][-1] < by_lightning["train_loss"][0]


def test_multirun_runs_each_job_once_with_its_own_outputs(tmp_path):
    from conftest import TINY, run_cli

    sweep = tmp_path / "sweep"
    args = ["--multirun", *TINY, "logger=wandb", "trainer.max_steps=3", "parallel.pp=2,1", f"hydra.sweep.dir={sweep}"]
    proc = run_cli("pipetrain.train", args, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in sorted(sweep.iterdir()) if d.is_dir()}
    assert sorted(summaries) == ["0", "1"]
    assert [s["world_size"] for s in summaries.values()] == [2, 1]
    assert summaries["0"]["train_loss"] == pytest.approx(summaries["1"]["train_loss"], rel=TOL)
    assert (sweep / "0" / "train_rank1.log").exists()  # the pp=2 job's second rank logged into its own job dir
    for job in ("0", "1"):  # one wandb run per job
        assert len(list((sweep / job / "wandb").glob("offline-run-*"))) == 1
    assert proc.stdout.count("pipetrain: 3 steps") == 2  # each job trained once


@pytest.mark.parametrize(
    ("model", "schedule"), [("gpt2", "interleaved_1f1b"), ("llama3", "interleaved_1f1b"), ("gpt2", "zbv")]
)
def test_validation_loss_equals_unpipelined(tmp_path, model, schedule):
    val = ("trainer.val_check_interval=2", "data.val_batches=2", "trainer.max_steps=4", "parallel.num_microbatches=4")
    ref = train_run(tmp_path / "ref", f"model={model}", "parallel=pp1", *val)
    got = train_run(tmp_path / "pp", f"model={model}", "parallel.pp=2", "parallel.vpp=2", f"schedule={schedule}", *val)
    assert len(ref["val_losses"]) == len(got["val_losses"]) == 2  # after steps 2 and 4
    for a, b in zip(got["val_losses"], ref["val_losses"], strict=True):
        assert abs(a - b) <= TOL * b
    assert got["val_loss"] == got["val_losses"][-1]


def test_default_main_job_learns_and_writes_its_summary(tmp_path):
    """The README's main job, all defaults (wandb offline): last loss below 75% of the first."""
    from conftest import run_cli

    proc = run_cli("pipetrain.train", [f"hydra.run.dir={tmp_path}"], timeout=600, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    cfg = summary["config"]
    assert cfg["parallel"]["pp"] >= 2 and cfg["data"]["name"] == "shakespeare"
    losses = summary["train_loss"]
    assert len(losses) == cfg["trainer"]["max_steps"]
    assert losses[-1] < 0.75 * losses[0]
    assert summary["val_loss"] is not None and summary["val_loss"] < 0.75 * losses[0]
    assert summary["tokens_per_s"] > 0 and summary["step_time_s"] > 0
    assert (tmp_path / "schedule.txt").read_text().startswith("schedule=1f1b pp=2")
    assert list((tmp_path / "wandb").glob("offline-run-*"))
