"""Point-to-point transport of activations and their gradients between pipeline ranks.

Sends are asynchronous (the executor never waits on a send before its next action) and receives
block: the semantics :func:`pipetrain.pipeline.check.check` proves deadlock-free. A send is posted
together with the next receive, in one ``batch_isend_irecv``, or alone when the next action
receives nothing. On NCCL a lone send can hold its stream until the peer posts the matching
receive; grouping the 1F1B exchange "send activation to r+1, receive gradient from r+1" with its
mirror image on r+1 lets NCCL match both at once (what torch.distributed.pipelining and
Megatron-LM's send_forward_recv_backward do). Every message
carries a tag derived from (direction, stage, microbatch), so a receive matches its own message
even when one rank pair carries activations and gradients in both directions (interleaved
schedules). Messages between two stages of the same rank never touch the process group.

Receive order: NCCL ignores tags and pairs the k-th send from a peer with the k-th receive posted
for it. A schedule may consume a peer's messages in another order than the peer sends them (ZB-V
and interleaved zero bubble do). :meth:`P2PComms.expect` gives, per peer, the tags in send order;
a receive then first takes, into a holding buffer, every earlier message of that peer. Waiting for
an earlier message never blocks longer than waiting for the wanted one, which the peer sends later,
so this adds no deadlock to a table that ``check`` accepts.

Prefetch (gloo): a receive's data only moves once it is posted, so a receive posted when its
consumer starts puts the transfer on the critical path. On gloo each peer's next expected message
is therefore always posted ahead (one buffer per peer), in send order, as soon as the previous one
arrives. On NCCL a posted receive would hold the communicator's stream, and this rank's own sends
behind it, until the peer sends; there receives stay on demand, grouped with the pending sends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ACTIVATION = 0
GRADIENT = 1


class PeerError(RuntimeError):
    """A message from pp rank ``peer`` never came: the peer died, or hung past the group's timeout."""

    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer


def _wait(work: dist.Work, *, rank: int, peer: int) -> None:
    try:
        work.wait()
    except RuntimeError as err:
        raise PeerError(peer, f"pp rank {rank}: waiting for a message from pp rank {peer} failed: {err}") from err


def message_tag(direction: int, stage: int, microbatch: int, num_microbatches: int) -> int:
    """Tag of the message that leaves ``stage`` (activation: to stage+1; gradient: to stage-1)."""
    return (stage * num_microbatches + microbatch) * 2 + direction


@dataclass(kw_only=True)
class P2PComms:
    """Tagged point-to-point messages over the pp process group.

    Attributes:
        group: the pp process group (None only when pp == 1, where every message is local).
        rank: this process's rank inside ``group``.
        device: where received buffers live (the model's device).
        dtype: wire dtype of activations and gradients.
        prefetch: post each peer's next receive ahead (default: on for gloo, off otherwise).
    """

    group: dist.ProcessGroup | None
    rank: int
    device: torch.device
    dtype: torch.dtype
    prefetch: bool | None = None
    _outbox: list = field(default_factory=list)
    _pending: list = field(default_factory=list)
    _local: dict = field(default_factory=dict)
    _expected: dict = field(default_factory=dict)
    _early: dict = field(default_factory=dict)
    _inflight: dict = field(default_factory=dict)
    _shape: tuple | None = None

    def __post_init__(self) -> None:
        if self.prefetch is None:
            self.prefetch = self.group is not None and dist.get_backend(self.group) == "gloo"

    def expect(self, incoming: dict[int, list[int]], shape: tuple[int, ...] | None = None) -> None:
        """Start a step: ``incoming[peer]`` lists the tags ``peer`` sends here, in its send order.

        Every message of a step has one shape, ``shape`` (B, T, C); with it, prefetching starts.
        """
        self._expected = {peer: deque(tags) for peer, tags in incoming.items() if peer != self.rank}
        self._shape = shape
        if self.prefetch and shape is not None:
            for peer in self._expected:
                self._prefetch(peer)

    def _prefetch(self, peer: int) -> None:
        queue = self._expected.get(peer)
        if not queue or peer in self._inflight:
            return
        tag = queue.popleft()
        buffer = torch.empty(self._shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(buffer, group=self.group, group_src=peer, tag=tag)
        self._inflight[peer] = (tag, work, buffer)

    def send(self, tensor: torch.Tensor, *, peer: int, tag: int) -> None:
        """Send ``tensor`` to pp rank ``peer`` without waiting for it to be received."""
        if peer == self.rank:
            # Detached, so the receiving stage starts a graph of its own: its input is a leaf
            # whose .grad is what its backward sends on, exactly as after a real transfer.
            self._local[tag] = tensor.detach()
            return
        payload = tensor.detach().to(self.dtype).contiguous()
        self._outbox.append(dist.P2POp(dist.isend, payload, group=self.group, group_peer=peer, tag=tag))

    def post_sends(self) -> None:
        """Post the queued sends on their own (the next action receives nothing)."""
        if self._outbox:
            self._post([])

    def _post(self, receives: list) -> list:
        """Post queued sends and ``receives`` as one batch; return the works to wait on."""
        ops, self._outbox = self._outbox + receives, []
        works = dist.batch_isend_irecv(ops)
        # Keep every payload alive until its send completes: the transport reads it asynchronously.
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        if len(works) == len(ops):
            # One work per op (gloo): wait on the receives only; sends finish in the background.
            n_sends = len(ops) - len(receives)
            self._pending += [(w, op.tensor) for w, op in zip(works[:n_sends], ops[:n_sends], strict=True)]
            return works[n_sends:]
        # Coalesced (NCCL): one work for the whole group; waiting orders the GPU streams, it does
        # not block the host.
        self._pending += [(w, tuple(op.tensor for op in ops)) for w in works]
        return works if receives else []

    def recv(self, shape: tuple[int, ...], *, peer: int, tag: int) -> torch.Tensor:
        """Block until the message ``tag`` from pp rank ``peer`` arrives; return it as a new tensor."""
        if peer == self.rank:
            return self._local.pop(tag)
        if tag in self._early:
            return self._early.pop(tag)
        if self.prefetch and self._shape is not None and peer in self._expected:
            self.post_sends()  # about to block: let the peers have what they wait for
            while peer in self._inflight:
                got, work, buffer = self._inflight.pop(peer)
                _wait(work, rank=self.rank, peer=peer)
                self._prefetch(peer)
                if got == tag:
                    return buffer
                self._early[got] = buffer
            raise RuntimeError(f"rank {self.rank}: no message with tag {tag} is expected from rank {peer}")
        queue = self._expected.get(peer)
        if queue:
            while queue[0] != tag:
                earlier = queue.popleft()
                self._early[earlier] = self._receive(shape, peer, earlier)
                if not queue:
                    raise RuntimeError(f"rank {self.rank}: no message with tag {tag} is expected from rank {peer}")
            queue.popleft()
        return self._receive(shape, peer, tag)

    def _receive(self, shape: tuple[int, ...], peer: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        op = dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=peer, tag=tag)
        for work in self._post([op]):
            _wait(work, rank=self.rank, peer=peer)
        return buffer

    def flush(self) -> None:
        """Post what is queued and wait for every outstanding send (end of a step)."""
        self.post_sends()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        assert not self._local, f"local messages never received: {sorted(self._local)}"
        assert not self._early, f"messages received but never used: {sorted(self._early)}"
        assert not self._inflight, f"receives posted for messages never sent: {sorted(self._inflight)}"
