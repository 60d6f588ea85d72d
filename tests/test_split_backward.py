"""Split backward (I then W) gives exactly the gradients of one full backward, on every kind of stage."""

from __future__ import annotations

import pytest
import torch

from pipetrain.config import GPT2Config, Llama3Config
from pipetrain.models import build_chunk
from pipetrain.pipeline.backward import backward_input, backward_weight
from pipetrain.pipeline.executor import summed_cross_entropy

B, T = 2, 16


def configs():
    yield GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, block_size=32)
    yield Llama3Config(n_layer=3, n_embd=32, n_head=4, n_kv_head=2, vocab_size=64, block_size=32, multiple_of=16)


def stage_io(chunk, config, *, first: bool, last: bool, seed: int):
    """(input leaf or None, output, grad of output or None) of one stage on random data."""
    gen = torch.Generator().manual_seed(seed)
    if first:
        x = None
        out = chunk(torch.randint(0, config.vocab_size, (B, T), generator=gen))
    else:
        x = torch.randn(B, T, config.n_embd, generator=gen).requires_grad_(True)
        out = chunk(x)
    if last:
        targets = torch.randint(0, config.vocab_size, (B, T), generator=gen)
        return x, summed_cross_entropy(out, targets) / (B * T), None
    return x, out, torch.randn(out.shape, generator=gen)


@pytest.mark.parametrize("config", list(configs()), ids=lambda c: c.family)
@pytest.mark.parametrize(
    ("first", "last"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["middle", "first", "last", "whole"],
)
def test_split_backward_equals_full_backward(config, first, last):
    n = config.n_layer
    chunk = build_chunk(config, layer_range=(0, n) if first else (1, n), has_embedding=first, has_head=last, seed=7)
    params = list(chunk.parameters())

    # Reference: one full backward per microbatch, accumulated over two microbatches.
    for mb in range(2):
        x, out, grad = stage_io(chunk, config, first=first, last=last, seed=mb)
        torch.autograd.backward(out, grad_tensors=grad)
        ref_input = None if x is None else x.grad.clone()
    ref = [p.grad.clone() for p in params]
    chunk.zero_grad(set_to_none=True)

    # Split: I of both microbatches first, then their W's (the deferred order zero-bubble uses).
    works = []
    for mb in range(2):
        x, out, grad = stage_io(chunk, config, first=first, last=last, seed=mb)
        grad_input, work = backward_input(out, grad, x, params)
        assert all(p.grad is None for p in params), "I must not touch weight gradients"
        works.append(work)
    if first:
        assert grad_input is None
    else:
        torch.testing.assert_close(grad_input, ref_input, rtol=1e-6, atol=1e-7)
    for work in works:
        backward_weight(work)
    for p, want, (name, _) in zip(params, ref, chunk.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7, msg=name)


def test_weight_work_skips_the_input_path():
    """W restarts at the boundary nodes: it computes no gradient for the stage input again."""
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32)
    chunk = build_chunk(config, layer_range=(0, 2), has_embedding=False, has_head=False, seed=3)
    x = torch.randn(B, T, 32).requires_grad_(True)
    out = chunk(x)
    grad_input, work = backward_input(out, torch.ones_like(out), x, list(chunk.parameters()))
    assert grad_input is not None and x.grad is None
    # One group per parameter-using op: far fewer groups than parameters would mean sharing works.
    n_params = sum(1 for _ in chunk.parameters())
    assert 0 < len(work.groups) <= n_params
    backward_weight(work)
    assert x.grad is None, "W must not produce an input gradient"
    assert all(p.grad is not None for p in chunk.parameters())


class _SharedWeight(torch.nn.Module):
    """One weight used at two depths of the input path, plus an ordinary layer."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(8, 8)
        self.other = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(torch.tanh(self.other(self.shared(x))))


def test_weight_used_twice_on_the_input_path():
    torch.manual_seed(0)
    module = _SharedWeight()
    x0, g = torch.randn(3, 8), torch.randn(3, 8)
    x = x0.clone().requires_grad_(True)
    module(x).backward(g)
    ref = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    _, work = backward_input(module(x), g, x, list(module.parameters()))
    backward_weight(work)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7, msg=n)
