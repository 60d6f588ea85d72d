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


def split(chunk, out, grad, x, *, last: bool):
    """backward_input as the executor calls it: the last stage's head weights are done in the I."""
    eager = list(chunk.head.parameters()) if last else []
    return backward_input(out, grad_output=grad, stage_input=x, params=list(chunk.parameters()), eager_params=eager)


@pytest.mark.parametrize("config", list(configs()), ids=lambda c: c.family)
@pytest.mark.parametrize(
    ("first", "last"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["middle", "first", "last", "whole"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_split_backward_equals_full_backward(config, first, last, dtype):
    n = config.n_layer
    chunk = build_chunk(config, layer_range=(0, n) if first else (1, n), has_embedding=first, has_head=last, seed=7)
    params = list(chunk.parameters())
    head = {id(p) for p in chunk.head.parameters()} if last else set()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    # Reference: one full backward per microbatch, accumulated over two microbatches.
    for mb in range(2):
        with autocast:
            x, out, grad = stage_io(chunk, config, first=first, last=last, seed=mb)
        torch.autograd.backward(out, grad_tensors=grad)
        ref_input = None if x is None else x.grad.clone()
    ref = [p.grad.clone() for p in params]
    chunk.zero_grad(set_to_none=True)

    # Split: I of both microbatches first, then their W's (the deferred order zero-bubble uses).
    works = []
    for mb in range(2):
        with autocast:
            x, out, grad = stage_io(chunk, config, first=first, last=last, seed=mb)
        grad_input, work = split(chunk, out, grad, x, last=last)
        del out
        # The I leaves every weight gradient alone, except the head's where the stage has an input.
        untouched = [p for p in params if first or id(p) not in head]
        assert all(p.grad is None for p in untouched), "I must not touch deferred weight gradients"
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


def test_tied_embedding_and_head_on_one_rank():
    """ZB-V's rank 0: stage 0 (embedding) and the last stage (head) share the tied weight."""
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32)
    whole = build_chunk(config, layer_range=(0, 2), has_embedding=True, has_head=True, seed=5)
    first = build_chunk(config, layer_range=(0, 1), has_embedding=True, has_head=False, seed=5)
    last = build_chunk(config, layer_range=(1, 2), has_embedding=False, has_head=True, seed=5)
    last.head.lm_head.weight = first.embed.wte.weight  # what configure_model does on such a rank
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(2))
    summed_cross_entropy(whole(tokens), targets).backward()
    h = first(tokens)
    x = h.detach().requires_grad_(True)
    loss = summed_cross_entropy(last(x), targets)
    grad_x, work_last = split(last, loss, None, x, last=True)
    _, work_first = backward_input(h, grad_output=grad_x, stage_input=None, params=list(first.parameters()))
    backward_weight(work_first)
    backward_weight(work_last)
    got = {**dict(first.named_parameters()), **dict(last.named_parameters())}
    for name, p in whole.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_weight_work_does_not_run_the_input_path_again():
    """W restarts at the boundary nodes: no other node of the input path runs in a W."""
    from torch.autograd.graph import get_gradient_edge

    from pipetrain.pipeline.backward import _ancestors, _parents

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32)
    chunk = build_chunk(config, layer_range=(0, 2), has_embedding=False, has_head=False, seed=3)
    x = torch.randn(B, T, 32).requires_grad_(True)
    out = chunk(x)
    parents = _parents(out.grad_fn)
    on_path = _ancestors(parents, get_gradient_edge(x).node)
    grad_input, work = backward_input(
        out, grad_output=torch.ones_like(out), stage_input=x, params=list(chunk.parameters())
    )
    assert grad_input is not None and all(p.grad is None for p in chunk.parameters())
    boundary = {edge.node for edges, _, _ in work.groups for edge in edges}
    assert boundary and boundary <= on_path and out.grad_fn not in boundary
    ran = []
    handles = [n.register_prehook(lambda g, n=n: ran.append(n)) for n in on_path - boundary]
    backward_weight(work)
    for handle in handles:
        handle.remove()
    assert ran == [], f"W ran {len(ran)} input-path nodes again"
    assert all(p.grad is not None for p in chunk.parameters())


def test_no_vocabulary_sized_tensor_outlives_the_last_stage_input_backward():
    """After the I of the last stage only the boundary nodes' saved tensors and recorded
    gradients stay: nothing of size (B, T, V) (logits, log-softmax, dL/d logits)."""
    import weakref

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=512, block_size=32)
    chunk = build_chunk(config, layer_range=(1, 2), has_embedding=False, has_head=True, seed=3)
    vocab_sized = []

    class Box:
        def __init__(self, t):
            # detached: a saved output keeping its own grad_fn through a Python object would form a
            # reference cycle that outlives the graph, in this test only
            self.t = t.detach()

    def pack(t):
        box = Box(t)
        if t.numel() >= B * T * config.vocab_size:
            vocab_sized.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        x, loss, _ = stage_io(chunk, config, first=False, last=True, seed=0)
    assert vocab_sized and all(ref() is not None for ref in vocab_sized)
    _, work = split(chunk, loss, None, x, last=True)
    del loss
    assert all(ref() is None for ref in vocab_sized), "a (B, T, V) tensor is still saved after the I"
    for _edges, seeds, _group in work.groups:
        assert all(seed.numel() < B * T * config.vocab_size for seed in seeds)
    backward_weight(work)


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
    _, work = backward_input(module(x), grad_output=g, stage_input=x, params=list(module.parameters()))
    backward_weight(work)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7, msg=n)
