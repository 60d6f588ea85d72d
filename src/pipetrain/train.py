"""Hydra entry point: compose -> validate -> build -> trainer.fit -> summary.json.

    python -m pipetrain.train [overrides]      (the console script pipetrain-train is the same)

Lightning's subprocess launcher re-runs this command for ranks 1..n-1 with the same run dir; under
torchrun every rank runs it. A config that cannot work fails in :func:`pipetrain.config.validate`
before any process is started, with one line naming the key.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pipetrain.config import register_configs, validate

log = logging.getLogger("pipetrain")


def config_dir() -> str:
    """conf/ inside an installed wheel, else the repository's conf/ (editable install)."""
    packaged = Path(__file__).parent / "conf"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf")


def _accelerator(cfg: DictConfig, processes_per_node: int) -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = cfg.trainer.accelerator
    if wanted == "cpu" or (wanted == "auto" and gpus < processes_per_node):
        return "cpu"
    if gpus < processes_per_node:
        warnings.warn(
            f"trainer.accelerator=gpu but this machine has {gpus} GPU(s) for {processes_per_node} processes; "
            "running them as CPU processes",
            stacklevel=2,
        )
        return "cpu"
    return "gpu"


def _logger(cfg: DictConfig, run_dir: Path, resume_id: str | None):
    name = cfg.logger.name
    if name == "none":
        return False
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(run_dir), name="csv", version="")
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.loggers import WandbLogger

    from pipetrain.sweep import in_sweep

    os.environ.setdefault("WANDB_SILENT", "true")
    group = cfg.logger.group
    if group is None and in_sweep():
        group = HydraConfig.get().sweep.dir  # a sweep's jobs side by side on the dashboard
    # A resumed run continues the wandb run its checkpoint was saved from.
    resume = {"id": resume_id, "resume": "allow"} if resume_id else {}
    return WandbLogger(
        project=cfg.logger.project,
        group=group,
        name=run_dir.name,
        save_dir=str(run_dir),
        offline=cfg.logger.mode == "offline",
        config=OmegaConf.to_container(cfg, resolve=True),
        **resume,
    )


def _median_after(values: list[float], skip: int) -> float | None:
    kept = values[skip:] if len(values) > skip else values
    return statistics.median(kept) if kept else None


def train(cfg: DictConfig, run_dir: Path, ckpt_path: Path | None = None) -> dict | None:
    """Train a validated ``cfg``; on global rank 0 return (and write) the run summary.

    Args:
        cfg: the composed, validated config.
        run_dir: the run's output dir (Hydra's), shared by all its ranks.
        ckpt_path: a checkpoint to resume from (resolved and checked, see
            :func:`pipetrain.checkpoint.resolve`), or None to start at step 0.
    """
    # Every rank holds the same broadcast validation loss, so Lightning's advice to sync it is moot.
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level")
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; nothing for users to do.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")

    import lightning as L
    import torch
    from lightning.pytorch.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    from pipetrain.checkpoint import CHECKPOINT_DIR, PipelineCheckpoint, read_trainer_state
    from pipetrain.data.datamodule import TokenDataModule
    from pipetrain.module import PipelineLM
    from pipetrain.profiling import PipelineTimeline
    from pipetrain.strategy import PipelineParallelStrategy

    par = cfg.parallel
    world = par.dp * par.pp
    nodes = cfg.trainer.num_nodes
    accelerator = _accelerator(cfg, world // nodes)
    if accelerator == "cpu" and cfg.trainer.cpu_threads_per_process:
        torch.set_num_threads(cfg.trainer.cpu_threads_per_process)

    model_cfg = OmegaConf.to_object(cfg.model)
    strategy = PipelineParallelStrategy(
        pp=par.pp,
        vpp=par.vpp,
        dp=par.dp,
        num_microbatches=par.num_microbatches,
        schedule=cfg.schedule.name,
        schedule_path=cfg.schedule.path,
        n_layer=model_cfg.n_layer,
        placement=par.placement,
        timeout_s=par.timeout_s,
    )
    module = PipelineLM(
        model_cfg,
        OmegaConf.to_object(cfg.optim),
        seed=cfg.seed,
        max_steps=cfg.trainer.max_steps,
        precision=cfg.trainer.precision,
        dump_grads_step=cfg.debug.dump_grads_step,
        dump_params=cfg.debug.dump_params,
        skip_nonfinite=cfg.train.skip_nonfinite,
        nonfinite_step=cfg.debug.nonfinite_step,
    )
    datamodule = TokenDataModule(
        cfg.data, num_microbatches=par.num_microbatches, seed=cfg.seed, max_steps=cfg.trainer.max_steps, dp_size=par.dp
    )
    val_every = cfg.trainer.val_check_interval
    timeline = PipelineTimeline(
        every_n_steps=cfg.timeline_every_n_steps,
        run_dir=run_dir,
        max_steps=cfg.trainer.max_steps,
        warmup_steps=cfg.timing_warmup_steps,
    )
    callbacks: list = [timeline]
    if cfg.checkpoint.every_n_steps:
        callbacks.append(
            PipelineCheckpoint(
                run_dir / CHECKPOINT_DIR, every_n_steps=cfg.checkpoint.every_n_steps, keep_last=cfg.checkpoint.keep_last
            )
        )
    # Continue the wandb run only when continuing this run dir; a new run started from another
    # run's checkpoint is a new wandb run (its config records resumed_from ... via ckpt_path).
    own = ckpt_path is not None and ckpt_path.resolve().parent == (run_dir / CHECKPOINT_DIR).resolve()
    wandb_id = read_trainer_state(ckpt_path).get("wandb_run_id") if own else None
    plugins = []
    if SLURMEnvironment.detect() and not TorchElasticEnvironment.detect():  # (torchrun in SLURM: torchrun's)
        # Requeueing is ckpt_path=last's job. Lightning's auto-requeue saves a checkpoint from
        # inside a signal handler, a collective that would meet the pipeline's own out of order.
        plugins.append(SLURMEnvironment(auto_requeue=False))
    trainer = L.Trainer(
        plugins=plugins,
        accelerator=accelerator,
        devices=world // nodes,
        num_nodes=nodes,
        strategy=strategy,
        precision=cfg.trainer.precision,
        max_steps=cfg.trainer.max_steps,
        logger=_logger(cfg, run_dir, wandb_id),
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        val_check_interval=val_every if val_every else None,
        check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=cfg.data.val_batches if val_every else 0,
        num_sanity_val_steps=0,
        enable_checkpointing=bool(cfg.checkpoint.every_n_steps),
        use_distributed_sampler=False,
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        callbacks=callbacks,
    )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
    finally:
        if cfg.logger.name == "wandb":
            import wandb

            wandb.finish()  # a sweep's next job must not log into this job's run
    if not trainer.is_global_zero:
        return None

    skip = cfg.timing_warmup_steps
    tokens_per_step = cfg.data.micro_batch_size * par.num_microbatches * par.dp * cfg.data.seq_len
    step_time = _median_after(module.step_times, skip)
    summary = {
        "train_loss": module.train_losses,
        "val_loss": module.val_losses[-1] if module.val_losses else None,
        "val_losses": module.val_losses,
        "grad_norm": module.grad_norms,
        "tokens_per_s": tokens_per_step / step_time if step_time else None,
        "step_time_s": step_time,
        "steps": len(module.train_losses),
        "first_step": trainer.global_step - len(module.train_losses),
        "resumed_from": str(ckpt_path) if ckpt_path is not None else None,
        "skipped_steps": module.skipped_steps,
        "checkpoints": sorted(str(p) for p in (run_dir / CHECKPOINT_DIR).glob("step=*")),
        "world_size": trainer.world_size,
        "accelerator": accelerator,
        **timeline.summary(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    # Strict JSON: a skipped step's NaN loss is written as null.
    (run_dir / "summary.json").write_text(json.dumps(_finite_or_null(summary), indent=2, allow_nan=False) + "\n")
    return summary


def _finite_or_null(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_null(v) for v in value]
    return value


class JobFailed(RuntimeError):
    """One job of a --multirun sweep failed (its message is printed); the sweep goes on."""


def _fail(message: str, code: int, *, say: bool = True) -> None:
    """Print ``message`` as one line (console and the run's log, when ``say``); end this run with
    ``code``, or fail only this job of a sweep."""
    from pipetrain.sweep import in_sweep

    if say:
        print(message, file=sys.stderr)
        log.error(message)
    if in_sweep():
        # sys.exit would end the whole sweep: Hydra records an exception as this job's failure.
        raise JobFailed(message) from None
    sys.exit(code)


def _first_process() -> bool:
    """Whether this is the job's first process (rank 0), before any process group exists."""
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            return os.environ[key] == "0"
    return True


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import OmegaConfBaseException

    from pipetrain.checkpoint import check_checkpoint, resolve

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
        with warnings.catch_warnings():
            if not _first_process():
                warnings.simplefilter("ignore")  # ckpt_path=last with nothing saved: said once, by rank 0
            ckpt_path = resolve(cfg.ckpt_path, run_dir)
        if ckpt_path is not None:
            check_checkpoint(ckpt_path, cfg.model)
    except (ValueError, OmegaConfBaseException) as err:
        # Before any process starts: one line naming the key, the value and the fix.
        _fail(f"pipetrain: config error: {' '.join(str(err).split())}", 2)
    from pipetrain.strategy import RankFailure

    try:
        summary = train(cfg, run_dir, ckpt_path)
    except (FloatingPointError, RankFailure) as err:
        # A run that cannot go on (a NaN loss, a lost rank): one line, exit code 1.
        # A NaN loss is the same on every rank: rank 0 says it. A lost peer is each rank's own story.
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        _fail(f"pipetrain: error: {err}", 1, say=isinstance(err, RankFailure) or rank_zero_only.rank == 0)
    if summary is not None:
        losses = summary["train_loss"]
        line = (
            f"pipetrain: {summary['steps']} steps, train loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"val loss {'n/a' if summary['val_loss'] is None else format(summary['val_loss'], '.4f')}, "
            f"{summary['tokens_per_s'] or 0:.0f} tokens/s; "
            f"summary: {run_dir / 'summary.json'}"
        )
        print(line)
        log.info(line)


def run_name(default: str) -> str:
    """Run-dir name shared by every rank of an externally launched job, else ``default``.

    ``torchrun-<job id>`` under torchrun when it has one (``--standalone``, ``--rdzv-id``);
    ``slurm-<job id>-<step id>`` in a job step started by SLURM's srun; otherwise ``default``.
    """
    job_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if job_id and job_id != "none":
        return f"torchrun-{job_id}"
    # Only ranks that srun started (a job step, not an salloc shell or the batch script itself):
    # other runs of the same allocation must not share one run dir.
    slurm_job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    interactive = os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
    if slurm_job and step is not None and "SLURM_NTASKS" in os.environ and not interactive:
        return f"slurm-{slurm_job}-{step}"
    return default


def main() -> None:
    """Console-script entry point (``pipetrain-train``)."""
    register_configs()
    OmegaConf.register_new_resolver("pipetrain_run_name", run_name, replace=True)
    _hydra_main()


if __name__ == "__main__":
    main()
