"""Data-parallel gradient averaging for pipeline stages: once per step, overlapped with the cool-down.

Every data-parallel replica runs the same task table on its own shard of the global batch, so
replica r's rank at pp rank p finishes its stages' backwards in the same order as every other
replica's rank at p. :class:`GradientAverager` keeps one flat bucket per local stage and starts
that bucket's all-reduce over the dp group as soon as the stage's last backward of the step is
done (the executor's ``on_grads_ready``), while the schedule goes on with the other stages'
cool-down; :meth:`GradientAverager.finish` waits and divides by dp. This is PyTorch DDP's
gradient bucketing, whose all-reduces overlap the backward (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, section 3.2), at stage
granularity: a stage's gradients are final only after its last microbatch, never per microbatch.

Each replica scales its microbatch losses by its own token count (DESIGN.md, contract 4), which is
the same on every replica, so the mean of the replicas' gradients is the gradient of the mean
loss over the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


class GradientAverager:
    """Average this rank's weight gradients over its data-parallel group, stage by stage.

    Args:
        group: the dp process group (this rank and the ranks holding the same stages in the
            other replicas).
        dp: the group's size, >= 2.
        stage_params: per local stage, its parameters. A parameter shared by two local stages
            (GPT-2's tied embedding/head when one rank holds both ends) is reduced once, with
            the stage whose gradients become final last.
        ready_order: the stages in the order the executor reports them ready
            (``PipelineExecutor.grads_ready_order``).

    Gradients are summed in their own dtype (under ``bf16-true`` the sum over replicas is a bf16
    sum) and divided by ``dp`` after the reduction; a parameter without a gradient gets zeros,
    so every replica reduces buckets of the same size. Each launched bucket is a flat copy of the
    stage's gradients (one extra copy of them while the all-reduce runs).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        dp: int,
        stage_params: dict[int, Iterable[nn.Parameter]],
        ready_order: list[int],
    ):
        self.group = group
        self.dp = dp
        # Walk stages from the last one ready backwards: a shared parameter joins the latest.
        self.buckets: dict[int, list[nn.Parameter]] = {}
        seen: set[int] = set()
        for stage in reversed(ready_order):
            own = [p for p in stage_params[stage] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in own)
            self.buckets[stage] = own
        self._pending: list[tuple[dist.Work, list[nn.Parameter], torch.Tensor]] = []
        self._launched: set[int] = set()

    def launch(self, stage: int) -> None:
        """Start the all-reduce of ``stage``'s gradients (asynchronous); call once per step per stage."""
        self._launched.add(stage)
        params = self.buckets[stage]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for same in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in same])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((work, same, flat))

    def finish(self) -> None:
        """Wait for every all-reduce (starting any stage not yet launched) and write the averages back."""
        for stage in self.buckets:
            if stage not in self._launched:
                self.launch(stage)
        for work, params, flat in self._pending:
            work.wait()
            flat.div_(self.dp)
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._pending.clear()
        self._launched.clear()
