"""Run one rank's task table: forwards, backwards and the messages between them.

The executor interprets actions; it never asks which schedule produced them. Shapes:
``B`` = micro_batch_size, ``T`` = seq_len, ``C`` = n_embd, ``V`` = vocab_size (the
models' legend).

Memory contract: an F stashes only what its backward needs (the received input and the chunk's
output, or the scaled loss on the last stage); a B frees it, an I hands the graph to its W, which
frees it; the last stage keeps one loss scalar per microbatch, never the logits.

Loss contract (DESIGN.md, 4): each microbatch's summed token loss is divided once, before its
backward, by the number of target tokens in the whole step, so the step's loss and gradients are
those of the mean over every token of the global batch, for any m, pp or vpp.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipetrain.pipeline.backward import WeightGradWork, backward_input, backward_weight
from pipetrain.pipeline.check import messages
from pipetrain.pipeline.comms import ACTIVATION, GRADIENT, P2PComms, message_tag
from pipetrain.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, ScheduleTable

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def summed_cross_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the token cross-entropies, computed in fp32."""
    return nn.functional.cross_entropy(
        logits_BTV.reshape(-1, logits_BTV.size(-1)).float(), targets_BT.reshape(-1), reduction="sum"
    )


class PipelineExecutor:
    """Walks this rank's actions of a :class:`ScheduleTable`.

    F runs a chunk; B runs its full backward; I computes only the gradient of the chunk's input and
    keeps what the matching W needs (see :mod:`pipetrain.pipeline.backward`); W then accumulates
    the weight gradients. Receives follow each peer's send order (see ``P2PComms.expect``), so the
    same table runs on NCCL, which matches messages by order, and on gloo, which matches tags.

    Every compute action is timed (``time.perf_counter_ns``, from after its input arrived to after
    its output was queued): :attr:`timings` holds the last step's ``(action, start_ns, end_ns)``
    and :attr:`step_span_ns` its ``(start_ns, end_ns)``.

    Args:
        table: the checked task table.
        rank: this process's pp rank.
        chunks: the local chunks keyed by global stage index.
        comms: the point-to-point transport.
        hidden_shape: shape of one microbatch's activation between stages, (B, T, C).
        loss_fn: ``(logits_BTV, targets_BT) -> summed loss`` (default: summed cross-entropy).
        on_grads_ready: called with a stage index right after that stage's last B or W of the
            step, when its weight gradients are final (training only). The strategy starts the
            stage's data-parallel all-reduce there, so it overlaps the rest of the cool-down.
            Stages come in the order of :attr:`grads_ready_order`.
    """

    def __init__(
        self,
        table: ScheduleTable,
        *,
        rank: int,
        chunks: dict[int, nn.Module],
        comms: P2PComms,
        hidden_shape: tuple[int, int, int],
        loss_fn: LossFn = summed_cross_entropy,
        on_grads_ready: Callable[[int], None] | None = None,
    ):
        self.table = table
        self.rank = rank
        self.chunks = chunks
        self.comms = comms
        self.hidden_shape = hidden_shape
        self.loss_fn = loss_fn
        self.last_stage = table.num_stages - 1
        self.actions = table.compute_actions(rank)
        self.on_grads_ready = on_grads_ready
        # Index of each stage's last weight-gradient action (B or W): its gradients are final then.
        last_grad_action = {a.stage: i for i, a in enumerate(self.actions) if a.kind in (BACKWARD, BACKWARD_WEIGHT)}
        self._grads_ready_at = {i: s for s, i in last_grad_action.items()}
        self.grads_ready_order: list[int] = [self._grads_ready_at[i] for i in sorted(self._grads_ready_at)]
        self.params = {s: [p for p in chunk.parameters() if p.requires_grad] for s, chunk in chunks.items()}
        # The LM head's weight gradient is computed in the I (see backward_input).
        self.eager = {
            s: list(chunk.head.parameters())
            if s == self.last_stage and getattr(chunk, "head", None) is not None
            else []
            for s, chunk in chunks.items()
        }
        self.timings: list[tuple[Action, int, int]] = []
        self.step_span_ns: tuple[int, int] = (0, 0)
        # Per peer, the tags of the messages it sends here, in its send order.
        self._incoming: dict[bool, dict[int, list[int]]] = {True: {}, False: {}}
        directions = {"activation": ACTIVATION, "gradient": GRADIENT}
        for (src, dst), (sent, _) in messages(table).items():
            if dst != rank:
                continue
            for kind, stage, mb in sent:
                tag = self._tag(directions[kind], stage, mb)
                self._incoming[False].setdefault(src, []).append(tag)
                if kind == "activation":
                    self._incoming[True].setdefault(src, []).append(tag)

    def _peer(self, stage: int) -> int:
        return self.table.placement[stage]

    def _tag(self, direction: int, stage: int, microbatch: int) -> int:
        return message_tag(direction, stage, microbatch, self.table.num_microbatches)

    def run(
        self,
        inputs: Sequence[torch.Tensor] | None,
        *,
        targets: Sequence[torch.Tensor] | None,
        num_tokens: int,
        forward_only: bool = False,
    ) -> torch.Tensor | None:
        """Run this rank's actions for one step.

        Args:
            inputs: per microbatch token ids (B, T) int64; used on the rank with stage 0.
            targets: per microbatch target ids (B, T) int64; used on the rank with the last stage.
            num_tokens: target tokens in the whole step (the loss divisor).
            forward_only: run only the F actions, without autograd (validation).

        Returns:
            On the rank holding the last stage, the step loss (0-dim fp32 tensor, mean over all
            ``num_tokens``); elsewhere None.

        Raises:
            RuntimeError: a peer failed or timed out (from torch.distributed).
        """
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        weight_work: dict[tuple[int, int], WeightGradWork] = {}
        losses: list[torch.Tensor] = []
        timings: list[tuple[Action, int, int]] = []
        clock = time.perf_counter_ns
        self.comms.expect(self._incoming[forward_only], shape=self.hidden_shape)
        step_start = clock()
        grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
        with grad_mode:
            for index, action in enumerate(self.actions):
                kind, s, mb = action.kind, action.stage, action.microbatch
                if forward_only and kind != FORWARD:
                    continue
                if kind == FORWARD:
                    x = None
                    if s > 0:
                        tag = self._tag(ACTIVATION, s - 1, mb)
                        x = self.comms.recv(self.hidden_shape, peer=self._peer(s - 1), tag=tag)
                    self.comms.post_sends()
                    start = clock()
                    if x is None:
                        out = self.chunks[s](inputs[mb])
                    else:
                        if not forward_only:
                            x.requires_grad_(True)
                        out = self.chunks[s](x)
                    if s == self.last_stage:
                        out = self.loss_fn(out, targets[mb]) / num_tokens
                        losses.append(out.detach())
                    else:
                        self.comms.send(out, peer=self._peer(s + 1), tag=self._tag(ACTIVATION, s, mb))
                    if not forward_only:
                        stash[(s, mb)] = (x, out)
                elif kind in (BACKWARD, BACKWARD_INPUT):
                    x, out = stash.pop((s, mb))
                    grad = None
                    if s < self.last_stage:
                        grad = self.comms.recv(out.shape, peer=self._peer(s + 1), tag=self._tag(GRADIENT, s + 1, mb))
                        grad = grad.to(out.dtype)
                    self.comms.post_sends()
                    start = clock()
                    if kind == BACKWARD:
                        torch.autograd.backward(out, grad_tensors=grad)
                        grad_input = None if x is None else x.grad
                    else:
                        grad_input, weight_work[(s, mb)] = backward_input(
                            out, grad_output=grad, stage_input=x, params=self.params[s], eager_params=self.eager[s]
                        )
                    # Drop this action's references: after an I only what its W needs stays alive.
                    del x, out, grad
                    if s > 0:
                        self.comms.send(grad_input, peer=self._peer(s - 1), tag=self._tag(GRADIENT, s, mb))
                elif kind == BACKWARD_WEIGHT:
                    self.comms.post_sends()
                    start = clock()
                    backward_weight(weight_work.pop((s, mb)))
                else:
                    raise ValueError(f"rank {self.rank}: the executor cannot run action {action}")
                timings.append((action, start, clock()))
                if self.on_grads_ready is not None and not forward_only and index in self._grads_ready_at:
                    self.on_grads_ready(self._grads_ready_at[index])
        self.comms.flush()
        self.timings = timings
        self.step_span_ns = (step_start, clock())
        assert not stash, f"rank {self.rank}: activations never freed by a backward: {sorted(stash)}"
        assert not weight_work, f"rank {self.rank}: I without its W: {sorted(weight_work)}"
        if not losses:
            return None
        return torch.stack(losses).sum()
