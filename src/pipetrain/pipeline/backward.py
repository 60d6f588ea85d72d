"""Split backward: the gradient of a stage's input now (I), of its weights later (W).

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2) split a
stage's backward in two. I computes only what the previous stage waits for, dL/d input; W
computes dL/d weights afterwards, from gradients that I already produced, so no work is done twice.

How, on an autograd graph from ``input`` to ``output``:

- the nodes on a path from the output to the input (the *input path*) are the only ones I runs;
  autograd skips every derivative not needed for ``input``, so I costs about half a full backward;
- a parameter hangs off the input path at one or more *boundary* nodes (the matmul that uses a
  weight, the norm that uses a scale). I records, with a pre-hook, the gradient flowing into each
  boundary node;
- W restarts autograd at those boundary nodes with the recorded gradients and asks only for the
  parameters that hang off them: the weight-gradient matmuls, nothing on the input path again.

The last stage computes its LM head's weight gradient in the I (``eager_params``): deferring it
would keep dL/d logits, a (B, T, V) tensor, per microbatch until the W. Parameters that share
boundary nodes are done in one autograd call. A parameter used at two
depths of the input path (one boundary node above the other) is done from the output instead:
correct, at the cost of running that path again. The first stage has no input
(its input is token ids), so its I does nothing and its W is the full backward. Gradients are
accumulated into ``param.grad`` as ``loss.backward()`` would, so a W equals the weight part of a
full backward (tested in tests/test_split_backward.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGradWork:
    """What a W needs: per group of parameters, the boundary edges and their recorded gradients.

    ``full`` is set instead when the whole backward was deferred (no input: the first stage).
    """

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.nn.Parameter]]] = field(default_factory=list)
    full: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Each node reachable from ``root``, with the nodes that feed it its gradient."""
    parents, seen, stack = {root: []}, {root}, [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _ancestors(parents: dict[Node, list[Node]], target: Node) -> set[Node]:
    """``target`` and every node from which it is reachable: the input path."""
    found, stack = {target}, [target]
    while stack:
        for parent in parents.get(stack.pop(), []):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _accumulate(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


def backward_input(
    output: torch.Tensor,
    *,
    grad_output: torch.Tensor | None,
    stage_input: torch.Tensor | None,
    params: Sequence[torch.nn.Parameter],
    eager_params: Sequence[torch.nn.Parameter] = (),
) -> tuple[torch.Tensor | None, WeightGradWork]:
    """I: the gradient of ``stage_input``; return it and the work a later W needs.

    Memory: after the I, only the boundary nodes (with the tensors they saved, the inputs of the
    weight-using operations) and the gradients recorded at their outputs stay alive, once the
    caller drops ``output``; the part of the graph above them is freed. ``eager_params`` get their
    weight gradient here instead (the LM head: its W would keep dL/d logits, (B, T, V), per
    microbatch).

    Args:
        output: the stage's output (hidden (B, T, C), or the scaled 0-dim loss on the last stage).
        grad_output: dL/d output, same shape as ``output`` (None for a 0-dim loss).
        stage_input: the stage's input, a leaf with ``requires_grad`` (None on the first stage,
            whose input is token ids: the whole backward is then deferred to the W).
        params: the stage's parameters (``eager_params`` among them or not).
        eager_params: parameters whose gradient is computed and accumulated in this I.

    Returns:
        (dL/d stage_input or None, the W work).

    Raises:
        RuntimeError: from autograd, e.g. when ``output`` does not depend on ``stage_input``.
    """
    eager_ids = {id(p) for p in eager_params}
    eager = [p for p in eager_params if p.requires_grad]
    deferred = [p for p in params if p.requires_grad and id(p) not in eager_ids]
    if stage_input is None:
        return None, WeightGradWork(full=(output, grad_output))
    root = output.grad_fn
    parents = _parents(root)
    on_path = _ancestors(parents, get_gradient_edge(stage_input).node)
    boundary_of: dict[torch.nn.Parameter, frozenset[Node]] = {}
    for p in deferred:
        acc = get_gradient_edge(p).node
        if acc not in parents:
            continue  # not used in this graph
        found, stack, seen = set(), [acc], {acc}
        while stack:
            for parent in parents.get(stack.pop(), []):
                if parent in on_path:
                    found.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        # A parameter that never meets the input path is reached from the output itself.
        boundary_of[p] = frozenset(found)
    captured: dict[Node, tuple] = {}
    handles = []
    for node in set().union(*boundary_of.values()) if boundary_of else ():

        def record(grad_outputs, node=node):
            captured[node] = grad_outputs

        handles.append(node.register_prehook(record))
    try:
        grads = torch.autograd.grad(
            output, [stage_input, *eager], grad_outputs=grad_output, retain_graph=True, allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    _accumulate(eager, grads[1:])
    work = WeightGradWork()
    groups: dict[frozenset[Node], list[torch.nn.Parameter]] = {}
    for p, nodes in boundary_of.items():
        groups.setdefault(nodes, []).append(p)
    for nodes, group in groups.items():
        edges, seeds = [], []
        if len(nodes) > 1 and any(_ancestors(parents, n) & (nodes - {n}) for n in nodes):
            # A weight used at two depths of the input path: restarting at both boundary nodes
            # would count the lower one's gradient twice. Restart from the output instead.
            nodes = frozenset()
        if not nodes:
            edges.append(get_gradient_edge(output))
            seeds.append(grad_output if grad_output is not None else torch.ones_like(output))
        for node in nodes:
            for i, g in enumerate(captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if edges:
            work.groups.append((edges, seeds, group))
    return grads[0], work


def backward_weight(work: WeightGradWork) -> None:
    """W: accumulate the weight gradients of ``work`` (from :func:`backward_input`) into ``.grad``."""
    if work.full is not None:
        output, grad_output = work.full
        torch.autograd.backward(output, grad_tensors=grad_output)
        return
    for edges, seeds, group in work.groups:
        _accumulate(group, torch.autograd.grad(edges, group, grad_outputs=seeds, retain_graph=True, allow_unused=True))
    work.groups.clear()
