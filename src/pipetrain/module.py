"""The LightningModule: builds this rank's chunks, runs a step through the strategy, optimizes, logs.

Manual optimization (DESIGN.md, Lightning facts): the schedule runs its own backwards, so a step
is ``zero_grad -> strategy.run_schedule -> sync tied grads -> global clip -> step``. Under
automatic optimization Lightning's closure would zero the schedule's gradients before its own
backward and the optimizer step would silently do nothing.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

from pipetrain.checkpoint import set_rng_state
from pipetrain.models import build_chunk


def comm_dtype_for(precision: str) -> torch.dtype:
    """Dtype of activations on the wire: the dtype the chunks produce under ``precision``."""
    if precision.startswith("bf16-true"):
        return torch.bfloat16
    if precision.startswith("16-true"):
        return torch.float16
    # 32-true and the "-mixed" precisions keep the residual stream in fp32.
    return torch.float32


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup over ``warmup_steps`` then cosine decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PipelineLM(L.LightningModule):
    """A GPT-2 or LLaMA-3 language model trained with pipeline parallelism.

    Args:
        model_cfg: a ``GPT2Config`` or ``Llama3Config`` (plain dataclass instance).
        optim_cfg: an ``OptimConfig``.
        seed: init seed; layer l's weights depend only on (seed, l).
        max_steps: optimizer steps of the run (for the LR schedule).
        precision: Lightning precision string (decides the wire dtype).
        dump_grads_step: if set, save this rank's gradients (by global name) after that step's
            backward, before clipping, to <run dir>/grads_rank<r>.pt.
        dump_params: save this rank's parameters (by global name) at the end of training to
            <run dir>/params_rank<r>.pt.
        skip_nonfinite: on a non-finite loss or gradient norm, skip the step (True) instead of
            raising FloatingPointError (False).
        nonfinite_step: test hook: at this step (1-based) the loss and gradients become NaN.
    """

    def __init__(
        self,
        model_cfg,
        optim_cfg,
        *,
        seed: int,
        max_steps: int,
        precision: str,
        dump_grads_step: int | None = None,
        dump_params: bool = False,
        skip_nonfinite: bool = False,
        nonfinite_step: int | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        self.seed = seed
        self.max_steps = max_steps
        self.comm_dtype = comm_dtype_for(precision)
        self.dump_grads_step = dump_grads_step
        self.dump_params = dump_params
        self.skip_nonfinite = skip_nonfinite
        self.nonfinite_step = nonfinite_step
        self.skipped_steps = 0
        self.grad_norms: list[float] = []
        self.chunks: nn.ModuleDict | None = None
        self.train_losses: list[float] = []
        self.step_times: list[float] = []
        self.val_losses: list[float] = []
        self._val_batch_losses: list[torch.Tensor] = []
        self._restored_rng: dict | None = None

    # ------------------------------------------------------------------ model

    def configure_model(self) -> None:
        if self.chunks is not None:
            return
        strategy = self.trainer.strategy
        info = strategy.stage_info
        last = strategy.table.num_stages - 1
        chunks = {
            str(stage): build_chunk(
                self.model_cfg, layer_range=rng, has_embedding=stage == 0, has_head=stage == last, seed=self.seed
            )
            for stage, rng in zip(info.stages, info.chunk_layer_ranges, strict=True)
        }
        self.chunks = nn.ModuleDict(chunks)
        # One rank holds the first and the last stage as different local chunks (pp == 1 with
        # vpp > 1, or ZB-V's rank 0): tie them with one shared Parameter.
        if "0" in chunks and str(last) in chunks and last != 0:
            for emb_name, head_name in type(chunks["0"]).tied_weights:
                owner, _, attr = head_name.rpartition(".")
                setattr(chunks[str(last)].get_submodule(owner), attr, chunks["0"].get_parameter(emb_name))

    def chunk_map(self) -> dict[int, nn.Module]:
        assert self.chunks is not None
        return {int(stage): chunk for stage, chunk in self.chunks.items()}

    def named_global_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by global name (``layers.7.attn.c_attn.weight``), each once."""
        out: dict[str, nn.Parameter] = {}
        seen: set[int] = set()
        for chunk in self.chunk_map().values():
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out[name] = p
        return out

    def tied_pairs(self) -> list[tuple[nn.Parameter | None, nn.Parameter | None]]:
        """(embedding-side, head-side) parameter of every tied pair, None where not on this rank."""
        params = self.named_global_parameters()
        chunk_cls = type(next(iter(self.chunk_map().values())))
        return [(params.get(e), params.get(h)) for e, h in chunk_cls.tied_weights if e in params or h in params]

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters counted in the global grad norm: a tied head copy counts on its embedding's rank."""
        params = self.named_global_parameters()
        chunk_cls = type(next(iter(self.chunk_map().values())))
        skip = {h for e, h in chunk_cls.tied_weights if h in params and e not in params}
        return [p for n, p in params.items() if n not in skip]

    def on_fit_start(self) -> None:
        # The parameter lists a step needs, computed once (the parameters are fixed objects now
        # that the model is on its device).
        self._params = list(self.named_global_parameters().values())
        self._tied = self.tied_pairs()
        self._norm_params = self.norm_parameters()
        # Dropout masks: reproducible per (seed, rank). With dropout > 0 a pipelined run draws
        # other masks than the unpipelined one, which is why the equivalence tests use dropout 0.
        # A run resumed at the layout that saved it continues the saved generator states.
        if self._restored_rng is not None:
            set_rng_state(self._restored_rng)
            self._restored_rng = None
        else:
            torch.manual_seed(self.seed + 7919 * self.trainer.strategy.global_rank)

    # ------------------------------------------------------------------ checkpoints

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # So that a resumed run logs into the same wandb run (train.py reads it back).
        from lightning.pytorch.loggers import WandbLogger

        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                checkpoint["wandb_run_id"] = logger.version
        checkpoint["skipped_steps"] = self.skipped_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._restored_rng = checkpoint.get("rng")
        self.skipped_steps = checkpoint.get("skipped_steps", 0)

    # ------------------------------------------------------------------ optimization

    def configure_optimizers(self):
        params = list(self.named_global_parameters().values())
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        cfg = self.optim_cfg
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(
                step, warmup_steps=cfg.warmup_steps, max_steps=self.max_steps, min_lr_ratio=cfg.min_lr_ratio
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        strategy = self.trainer.strategy
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        optimizer.zero_grad(set_to_none=True)
        loss = strategy.run_schedule(
            self.chunk_map(), batch, hidden_dim=self.model_cfg.n_embd, comm_dtype=self.comm_dtype, train=True
        )
        strategy.sync_tied_gradients(self._tied)
        step = self.global_step + 1
        if step == self.nonfinite_step:
            loss = loss * math.nan
            for p in self._params:
                if p.grad is not None:
                    p.grad.fill_(math.nan)
        if self.dump_grads_step is not None and step == self.dump_grads_step:
            self._dump_grads(strategy.global_rank)
        grad_norm = strategy.clip_grad_norm(self._params, self.optim_cfg.grad_clip, norm_params=self._norm_params)
        lr = optimizer.param_groups[0]["lr"]
        # The loss (broadcast, dp-averaged) and the global norm are the same on every rank, so
        # every rank takes the same branch: no rank is left waiting in a collective.
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            if not self.skip_nonfinite:
                raise FloatingPointError(
                    f"non-finite training loss {loss.item()} / gradient norm {grad_norm.item()} at step {step}; "
                    f"the weights of step {step - 1} are kept and no checkpoint of step {step} is written. "
                    "Lower optim.lr or raise the warmup, or set train.skip_nonfinite=true to skip such steps"
                )
            # Skip: no weight update, but the step counts (global_step, the data and the LR move on).
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.print(f"pipetrain: step {step}: non-finite loss or gradient norm, step skipped")
        optimizer.step()
        scheduler.step()
        step_time = time.perf_counter() - start
        tokens = batch.shape[0] * (batch.shape[1] - 1) * strategy.dp
        self.train_losses.append(loss.item())
        self.step_times.append(step_time)
        self.grad_norms.append(grad_norm.item())
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/lr", lr, on_step=True)
        self.log("train/grad_norm", grad_norm, on_step=True)
        self.log("train/tokens_per_s", tokens / step_time, on_step=True, prog_bar=True)
        self.log("train/step_time_s", step_time, on_step=True)
        self.log("train/skipped_steps", float(self.skipped_steps), on_step=True)
        return loss

    def _dump_grads(self, global_rank: int) -> None:
        params = self.named_global_parameters()
        grads = {n: p.grad.detach().cpu().clone() for n, p in params.items() if p.grad is not None}
        torch.save(grads, Path(self.trainer.default_root_dir) / f"grads_rank{global_rank}.pt")

    def on_train_end(self) -> None:
        if self.dump_params:
            params = {n: p.detach().cpu().clone() for n, p in self.named_global_parameters().items()}
            rank = self.trainer.strategy.global_rank
            torch.save(params, Path(self.trainer.default_root_dir) / f"params_rank{rank}.pt")

    # ------------------------------------------------------------------ validation

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.trainer.strategy.run_schedule(
            self.chunk_map(), batch, hidden_dim=self.model_cfg.n_embd, comm_dtype=self.comm_dtype, train=False
        )
        self._val_batch_losses.append(loss)

    def on_validation_epoch_end(self) -> None:
        if not self._val_batch_losses:
            return
        val = torch.stack(self._val_batch_losses).mean()
        self._val_batch_losses.clear()
        self.val_losses.append(val.item())
        # Every rank holds the same broadcast value, so no cross-rank reduction is needed.
        self.log("val/loss", val, prog_bar=True, sync_dist=False, rank_zero_only=True)
