"""Distributed checkpoints under global parameter names, written with ``torch.distributed.checkpoint``.

A checkpoint is a directory ``<run dir>/checkpoints/step=N.ckpt`` holding:

- the DCP files (``.metadata`` and ``*.distcp``): every parameter as ``model.<global name>``
  (``model.layers.7.attn.c_attn.weight``) and every optimizer state tensor as
  ``optim.<global name>.<field>`` (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``). Each rank
  writes what it owns; data-parallel replicas hold equal copies, which DCP writes once. A GPT-2
  head copy held away from its embedding (pp > 1) is written under its own name too, so a
  checkpoint of any layout holds every name a later layout may ask for;
- ``trainer_state.pt`` (global rank 0): the rest of Lightning's checkpoint (loop progress, LR
  scheduler, callback states), the optimizer's hyperparameters per group, the layout that saved it
  and the wandb run id;
- ``rng_rank<r>.pt`` per global rank: torch's CPU (and CUDA) generator states.

Because names are global and no tensor is keyed by rank or stage, a checkpoint saved at one
(pp, vpp, dp) loads at any other (DESIGN.md, contract 6). The generator states are restored only
at the layout that saved them; after a reshard each rank is seeded afresh.

Saves are atomic: everything is written under ``.step=N.ckpt.partial`` and renamed once every
rank has finished, so a crash mid-save leaves the previous checkpoints as they were.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 1
_STEP_NAME = re.compile(r"^step=(\d+)(\.ckpt)?$")


class CheckpointError(ValueError):
    """A checkpoint path that cannot be loaded: the message names the path and the problem."""


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, field: str) -> str:
    return f"optim.{name}.{field}"


def rng_file(global_rank: int) -> str:
    return f"rng_rank{global_rank}.pt"


def partial_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.partial")


# ---------------------------------------------------------------------------------- finding


def step_of(path: Path) -> int | None:
    """N for a checkpoint named ``step=N`` or ``step=N.ckpt``, else None."""
    match = _STEP_NAME.match(path.name)
    return int(match.group(1)) if match else None


def find_last(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``run_dir/checkpoints``, or None.

    Partial saves (``.step=N.ckpt.partial``) are never chosen. A first save of a step that was
    being saved again when the process died (``.step=N.ckpt.old``) is moved back into place.
    """
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if step_of(p) is not None and is_complete(p)]
    # A crash while a step was saved a second time can leave its first save renamed aside.
    for old in root.glob(".step=*.old"):
        final = old.with_name(old.name[1 : -len(".old")])
        if not final.exists() and step_of(final) is not None and is_complete(old):
            os.replace(old, final)
            complete.append(final)
    return max(complete, key=step_of, default=None)


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / TRAINER_STATE_FILE).is_file()


def resolve(ckpt_path: str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``ckpt_path`` names: None, ``"last"`` (newest in ``run_dir``), a checkpoint
    directory, or another run's dir (its newest complete checkpoint).

    ``"last"`` with no checkpoint in ``run_dir`` yields None with a warning (a first start of a
    job that requeues itself with ``ckpt_path=last``).

    Raises:
        CheckpointError: the path does not exist or is not a complete pipetrain checkpoint.
    """
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        found = find_last(run_dir)
        if found is None:
            warnings.warn(
                f"ckpt_path=last: no complete checkpoint under {run_dir / CHECKPOINT_DIR}; training from scratch",
                stacklevel=2,
            )
        return found
    path = Path(ckpt_path).expanduser().absolute()
    if not path.exists():
        raise CheckpointError(f"ckpt_path={ckpt_path}: no such checkpoint")
    if (path / CHECKPOINT_DIR).is_dir():  # a run dir: its newest complete checkpoint
        found = find_last(path)
        if found is None:
            raise CheckpointError(f"ckpt_path={ckpt_path}: the run dir holds no complete checkpoint")
        return found
    if not path.is_dir() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is not a pipetrain checkpoint: expected a directory holding "
            "torch.distributed.checkpoint's .metadata (<run dir>/checkpoints/step=N.ckpt)"
        )
    if not (path / TRAINER_STATE_FILE).is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path}: {TRAINER_STATE_FILE} is missing (an incomplete save?)")
    return path


# ---------------------------------------------------------------------------------- reading


def read_tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor key of the DCP checkpoint at ``path`` with its (shape, dtype).

    Raises:
        CheckpointError: ``.metadata`` cannot be read.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to parse is reported with the file named
        raise CheckpointError(f"{path / '.metadata'}: cannot be read as a torch.distributed.checkpoint: {err}") from err
    return {
        key: (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state (Lightning's checkpoint without tensors of the model or optimizer).

    Raises:
        CheckpointError: the file is missing, unreadable, or of another format version.
    """
    file = path / TRAINER_STATE_FILE
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{file}: cannot be read: {err}") from err
    version = state.get("pipetrain", {}).get("format") if isinstance(state, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: checkpoint format {version!r}, but this pipetrain reads format {FORMAT_VERSION}; "
            "load it with the pipetrain version that wrote it"
        )
    return state


def check_checkpoint(path: Path, model_cfg: Any) -> None:
    """Everything that can be checked before any process starts: the trainer state reads, and
    the parameters fit the model (:func:`check_fits`).

    Raises:
        CheckpointError: naming the file and the problem.
    """
    read_trainer_state(path)
    check_fits(path, model_cfg)


def full_model_shapes(model_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every global parameter name of the whole model with its shape (built on the meta device)."""
    from pipetrain.models import build_chunk

    whole = build_chunk(
        model_cfg, layer_range=(0, model_cfg.n_layer), has_embedding=True, has_head=True, seed=0, materialize=False
    )
    return {name: tuple(t.shape) for name, t in whole.state_dict().items()}


def tied_aliases(model_cfg: Any) -> dict[str, str]:
    """For each tied name, the other name of its pair (the two hold equal values)."""
    from pipetrain.models import MODEL_FAMILIES

    pairs = MODEL_FAMILIES[model_cfg.family].tied_weights
    return {**{e: h for e, h in pairs}, **{h: e for e, h in pairs}}


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_fits(path: Path, model_cfg: Any) -> None:
    """Refuse a checkpoint whose parameters are not exactly the model's (names and shapes).

    A tied pair counts as present when either name is (the two hold equal values).

    Raises:
        CheckpointError: naming the checkpoint, and the missing, unexpected or misshapen keys.
    """
    saved = {
        key.removeprefix("model."): shape
        for key, (shape, _) in read_tensor_shapes(path).items()
        if key.startswith("model.")
    }
    wanted = full_model_shapes(model_cfg)
    alias = tied_aliases(model_cfg)
    missing = sorted(model_key(n) for n in wanted if n not in saved and alias.get(n) not in saved)
    unexpected = sorted(model_key(n) for n in saved if n not in wanted)
    misshapen = sorted(
        f"{model_key(n)} {saved[n]} vs model {wanted[n]}" for n in wanted if n in saved and tuple(saved[n]) != wanted[n]
    )
    saved_layers = {int(n.split(".")[1]) for n in saved if n.startswith("layers.")}
    problems = []
    if missing:
        problems.append(f"missing keys: {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listed(unexpected)}")
    if misshapen:
        problems.append(f"shape mismatches: {_listed(misshapen)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} ({len(saved_layers)} layers) does not fit model.family={model_cfg.family} "
            f"model.n_layer={model_cfg.n_layer} model.n_embd={model_cfg.n_embd}: " + "; ".join(problems)
        )


# ---------------------------------------------------------------------------------- state


def tensors_to_save(params: Mapping[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's DCP state: its parameters and their optimizer state, under global names.

    Args:
        params: this rank's parameters by global name, each Parameter once.
        optimizer: the optimizer over exactly those parameters.
    """
    name_of = {id(p): n for n, p in params.items()}
    state: dict[str, torch.Tensor] = {model_key(n): p.detach() for n, p in params.items()}
    for p, fields in optimizer.state.items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                state[optim_key(name_of[id(p)], field)] = value
    return state


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (lr, betas, ...) without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class LoadPlan:
    """What this rank reads from a checkpoint: its parameters in place, and optimizer state buffers.

    Args:
        path: the checkpoint directory.
        params: this rank's parameters by global name.
        aliases: tied-name pairs (:func:`tied_aliases`): a name the checkpoint lacks is read from
            its partner.

    Attributes:
        request: the DCP state dict to load (keys in the checkpoint, tensors to fill).
        optim_state: per global name, the optimizer fields that will be filled.
    """

    def __init__(self, path: Path, *, params: Mapping[str, nn.Parameter], aliases: Mapping[str, str]):
        saved = read_tensor_shapes(path)
        self.request: dict[str, torch.Tensor] = {}
        self.optim_state: dict[str, dict[str, torch.Tensor]] = {}
        fields: dict[str, list[str]] = {}
        for key in saved:
            if key.startswith("optim."):
                name, _, field = key.removeprefix("optim.").rpartition(".")
                fields.setdefault(name, []).append(field)
        for name, p in params.items():
            source = name if model_key(name) in saved else aliases.get(name, name)
            if model_key(source) not in saved:
                raise CheckpointError(f"checkpoint {path}: missing key {model_key(name)}")
            shape = saved[model_key(source)][0]
            if shape != tuple(p.shape):
                raise CheckpointError(
                    f"checkpoint {path}: {model_key(source)} has shape {shape}, the model {tuple(p.shape)}"
                )
            self.request[model_key(source)] = p.detach()
            for field in fields.get(source, []):
                shape, dtype = saved[optim_key(source, field)]
                buffer = torch.empty(shape, dtype=dtype)
                self.request[optim_key(source, field)] = buffer
                self.optim_state.setdefault(name, {})[field] = buffer

    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, params: Mapping[str, nn.Parameter], hyperparameters: list[dict]
    ) -> dict[str, Any]:
        """A ``state_dict`` for ``optimizer`` built from the loaded buffers (after the DCP load).

        Raises:
            CheckpointError: the checkpoint's optimizer has another number of param groups.
        """
        if len(hyperparameters) != len(optimizer.param_groups):
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(hyperparameters)} param groups, this one "
                f"{len(optimizer.param_groups)}"
            )
        name_of = {id(p): n for n, p in params.items()}
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        index = 0
        for group, saved in zip(optimizer.param_groups, hyperparameters, strict=True):
            ids = []
            for p in group["params"]:
                loaded = self.optim_state.get(name_of[id(p)])
                if loaded:
                    state[index] = dict(loaded)
                ids.append(index)
                index += 1
            groups.append({**saved, "params": ids})
        return {"state": state, "param_groups": groups}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_synced(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` and fsync it, so that a completed save survives a node crash."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:  # some network and FUSE file systems cannot fsync a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def replace_dir(partial: Path, final: Path) -> None:
    """Move a finished save into place; an older save of the same name is removed only after.

    The rename is made durable (the parent directory is fsynced).
    """
    _sync_dir(partial)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    _sync_dir(final.parent)


# ---------------------------------------------------------------------------------- callback


class PipelineCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint saving every ``every_n_steps`` optimizer steps and at the last one.

    Entries are named ``step=N.ckpt``; the ``keep_last`` newest are kept (``monitor="step"``),
    older ones are deleted only after a newer save completed. The writing itself is the
    strategy's (:meth:`PipelineParallelStrategy.save_checkpoint`): one DCP directory per save.

    Args:
        dirpath: the run's checkpoint directory.
        every_n_steps: save after every this many optimizer steps (>= 1).
        keep_last: how many of the newest checkpoints to keep (>= 1).
    """

    def __init__(self, dirpath: Path, *, every_n_steps: int, keep_last: int):
        super().__init__(
            dirpath=str(dirpath),
            filename="{step}",
            monitor="step",
            mode="max",
            save_top_k=keep_last,
            every_n_train_steps=every_n_steps,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Manual optimization: global_step counts optimizer steps, and the weights are those after
        # the step, matching the loop progress Lightning saves with them.
        step = trainer.global_step
        due = step % self._every_n_train_steps == 0 or step == trainer.max_steps
        if due and not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
