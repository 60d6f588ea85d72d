"""Point-to-point transport of activations and their gradients between pipeline ranks.

Sends are asynchronous (the executor never waits on a send before its next action) and receives
block: the semantics :func:`pipetrain.pipeline.check.check` proves deadlock-free. Every message
carries a tag derived from (direction, stage, microbatch), so a receive matches its own message
even when one rank pair carries activations and gradients in both directions (interleaved
schedules). Messages between two stages of the same rank never touch the process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ACTIVATION = 0
GRADIENT = 1


def message_tag(direction: int, stage: int, microbatch: int, num_microbatches: int) -> int:
    """Tag of the message that leaves ``stage`` (activation: to stage+1; gradient: to stage-1)."""
    return (stage * num_microbatches + microbatch) * 2 + direction


@dataclass
class P2PComms:
    """Tagged point-to-point messages over the pp process group.

    Attributes:
        group: the pp process group (None only when pp == 1, where every message is local).
        rank: this process's rank inside ``group``.
        device: where received buffers live (the model's device).
        dtype: wire dtype of activations and gradients.
    """

    group: dist.ProcessGroup | None
    rank: int
    device: torch.device
    dtype: torch.dtype
    _pending: list = field(default_factory=list)
    _local: dict = field(default_factory=dict)

    def send(self, tensor: torch.Tensor, *, peer: int, tag: int) -> None:
        """Send ``tensor`` to pp rank ``peer`` without waiting for it to be received."""
        if peer == self.rank:
            # Detached, so the receiving stage starts a graph of its own: its input is a leaf
            # whose .grad is what its backward sends on, exactly as after a real transfer.
            self._local[tag] = tensor.detach()
            return
        payload = tensor.detach().to(self.dtype).contiguous()
        op = dist.P2POp(dist.isend, payload, group=self.group, group_peer=peer, tag=tag)
        # Keep the payload alive until the send completes: the transport reads it asynchronously.
        self._pending += [(work, payload) for work in dist.batch_isend_irecv([op])]
        self._pending = [(w, p) for w, p in self._pending if not w.is_completed()]

    def recv(self, shape: tuple[int, ...], *, peer: int, tag: int) -> torch.Tensor:
        """Block until the message ``tag`` from pp rank ``peer`` arrives; return it as a new tensor."""
        if peer == self.rank:
            return self._local.pop(tag)
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        op = dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=peer, tag=tag)
        for work in dist.batch_isend_irecv([op]):
            work.wait()
        return buffer

    def flush(self) -> None:
        """Wait for every outstanding send (end of a step)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        assert not self._local, f"local messages never received: {sorted(self._local)}"
