"""pipetrain's executor vs torch.distributed.pipelining: same model, same batch, same weights, one run.

    python benchmarks/vs_torch_pipelining.py [--rounds 4] [--warmup 1] [--steps 4] [--pairs gpipe 1f1b ...]
    python benchmarks/vs_torch_pipelining.py --mode efficiency

The script spawns pp=2 CPU processes (gloo, one thread each, so the pipeline uses both cores). For
every schedule pair it builds the chunks once, wraps the very same chunk modules in torch's
``PipelineStage`` for torch's side and hands them to pipetrain's ``PipelineExecutor`` for the other,
so both sides run identical weights on an identical batch (token ids drawn from a fixed seed).

Pairs (torch class vs pipetrain schedule; pp=2)::

    ScheduleGPipe                 vs gpipe             vpp=1
    Schedule1F1B                  vs 1f1b              vpp=1
    ScheduleInterleaved1F1B       vs interleaved_1f1b  vpp=2, loop placement
    ScheduleZBVZeroBubble         vs zbv               vpp=2, V placement (rank r: stages r, 2*pp-1-r)
    ScheduleInterleavedZeroBubble vs interleaved_zb    vpp=2, loop placement

--mode efficiency also runs zb_h1 and looped_bfs (vpp=2), which have no torch counterpart here.

Loss: both sides use the summed token cross-entropy of a microbatch divided by the tokens of the
whole step (torch with ``scale_grads=False``), i.e. the mean token loss of the step. At start-up
each pair runs one step on each side and asserts that every parameter gradient agrees within
1e-5 (the printed "max |grad diff|"), and prints the step losses of both.

--mode time (default) columns, per pair:
    torch ms      median step time of torch's schedule
    pipetrain ms  median step time of pipetrain's executor
    ratio         pipetrain / torch (below 1: pipetrain is faster)
    IQR ms        interquartile range of the step times of each side: the noise to judge a ratio by
A step is forward + backward of the whole global batch (no optimizer); gradients are zeroed
(set to None) between steps, outside the timed region. Each step is timed on rank 0 between two
barriers over both ranks. Per round and pair: ``--warmup`` untimed then ``--steps`` timed steps of
one side, then of the other; the side that goes first alternates between rounds. Medians are over
every timed step of every round. The last line is ``worst ratio: X``, the largest ratio; the line
before it gives the 1-minute load average: well above pp, other processes shared the cores and the
ratios are noise (on a 2-core machine, run nothing else meanwhile).

--mode efficiency columns, per pipetrain schedule (torch is not timed):
    bubble        simulated bubble of the task table (pipetrain.pipeline.simulate), max over ranks,
                  with per-kind costs measured on one process: F, B = step - F, I = W = B / 2
                  (each divided by vpp per stage)
    ideal ms      single-process step time / pp / (1 - bubble)
    measured ms   median pipetrain step time, as in --mode time
    efficiency    ideal / measured
The single-process step runs the whole model on the same batch in the same m microbatches, one
thread, on both processes at once (so memory bandwidth is shared as in the pipelined run).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import pipelining

from pipetrain.config import GPT2Config
from pipetrain.models import build_chunk
from pipetrain.pipeline.check import check
from pipetrain.pipeline.comms import P2PComms
from pipetrain.pipeline.executor import PipelineExecutor, summed_cross_entropy
from pipetrain.pipeline.partition import stage_layer_ranges
from pipetrain.pipeline.schedules import ScheduleTable, build_schedule
from pipetrain.pipeline.simulate import simulate_rank_share

PP = 2
SEED = 1234
GRAD_TOLERANCE = 1e-5
DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class Pair:
    """A torch.distributed.pipelining schedule class and the pipetrain schedule it is compared with."""

    torch_class: str | None
    schedule: str
    vpp: int

    @property
    def label(self) -> str:
        if self.torch_class is None:
            return f"{self.schedule} (vpp={self.vpp}, pipetrain only)"
        return f"{self.torch_class} vs {self.schedule} (vpp={self.vpp})"


PAIRS = (
    Pair("ScheduleGPipe", "gpipe", 1),
    Pair("Schedule1F1B", "1f1b", 1),
    Pair("ScheduleInterleaved1F1B", "interleaved_1f1b", 2),
    Pair("ScheduleZBVZeroBubble", "zbv", 2),
    Pair("ScheduleInterleavedZeroBubble", "interleaved_zb", 2),
    # torch has no ZB-H1 or looped BFS at vpp=2 over this API; --mode efficiency times them too.
    Pair(None, "zb_h1", 1),
    Pair(None, "looped_bfs", 2),
)


@dataclass(frozen=True)
class Batch:
    """One step's data, identical on every rank: x_BT token ids, y_BT targets (x shifted by one)."""

    x_BT: torch.Tensor
    y_BT: torch.Tensor
    num_microbatches: int

    @property
    def num_tokens(self) -> int:
        return self.y_BT.numel()

    @property
    def x_microbatches(self) -> list[torch.Tensor]:
        return list(self.x_BT.split(self.x_BT.size(0) // self.num_microbatches))

    @property
    def y_microbatches(self) -> list[torch.Tensor]:
        return list(self.y_BT.split(self.y_BT.size(0) // self.num_microbatches))


def mean_token_loss(num_tokens: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Torch's per-microbatch loss: summed token cross-entropy / tokens in the step (as pipetrain's)."""

    def loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits_BTV, targets_BT) / num_tokens

    return loss_fn


class TorchSide:
    """The local stages of one rank wrapped in torch's PipelineStage, driven by a torch schedule."""

    def __init__(self, pair: Pair, *, chunks: dict[int, nn.Module], num_stages: int, batch: Batch, model: GPT2Config):
        self.batch = batch
        self.has_first = 0 in chunks
        self.has_last = num_stages - 1 in chunks
        mb = batch.x_BT.size(0) // batch.num_microbatches
        T = batch.x_BT.size(1)
        hidden_BTC = torch.zeros(mb, T, model.n_embd, requires_grad=True)
        logits_BTV = torch.zeros(mb, T, model.vocab_size, requires_grad=True)
        stages = []
        for s, chunk in sorted(chunks.items()):
            # Static shapes, so no metadata exchange on the first step. requires_grad of the example
            # input matters: torch copies it onto received activations, and with False no gradient
            # goes back, so the previous stage's backward fails with "grad can be implicitly created
            # only for scalar outputs" (torch 2.13).
            example_in = batch.x_microbatches[0] if s == 0 else hidden_BTC
            example_out = logits_BTV if s == num_stages - 1 else hidden_BTC
            stages.append(
                pipelining.PipelineStage(
                    chunk, s, num_stages, DEVICE, input_args=example_in, output_args=example_out, group=None
                )
            )
        schedule_cls = getattr(pipelining, pair.torch_class)
        self.schedule = schedule_cls(
            stages[0] if pair.vpp == 1 else stages,
            n_microbatches=batch.num_microbatches,
            loss_fn=mean_token_loss(batch.num_tokens),
            scale_grads=False,
        )
        stage_to_rank = getattr(self.schedule, "stage_index_to_group_rank", None)
        self.placement = (
            tuple(stage_to_rank[s] for s in range(num_stages))
            if stage_to_rank is not None
            else tuple(s % PP for s in range(num_stages))
        )

    def step(self) -> torch.Tensor | None:
        """One forward + backward of the batch; the step loss on the last stage's rank, else None."""
        args = (self.batch.x_BT,) if self.has_first else ()
        target = self.batch.y_BT if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return torch.stack(losses).sum().detach() if losses else None


class PipetrainSide:
    """The same local chunks run by pipetrain's executor over the same process group."""

    def __init__(self, table: ScheduleTable, *, rank: int, chunks: dict[int, nn.Module], batch: Batch, n_embd: int):
        self.batch = batch
        self.has_first = 0 in chunks
        self.has_last = table.num_stages - 1 in chunks
        comms = P2PComms(group=dist.group.WORLD, rank=rank, device=DEVICE, dtype=torch.float32)
        mb = batch.x_BT.size(0) // batch.num_microbatches
        self.executor = PipelineExecutor(
            table, rank=rank, chunks=chunks, comms=comms, hidden_shape=(mb, batch.x_BT.size(1), n_embd)
        )
        self.x_mbs = batch.x_microbatches if self.has_first else None
        self.y_mbs = batch.y_microbatches if self.has_last else None

    def step(self) -> torch.Tensor | None:
        """One forward + backward of the batch; the step loss on the last stage's rank, else None."""
        return self.executor.run(self.x_mbs, targets=self.y_mbs, num_tokens=self.batch.num_tokens)


@dataclass
class PairRun:
    """Everything one rank holds for one pair."""

    pair: Pair
    table: ScheduleTable
    chunks: dict[int, nn.Module]
    torch_side: TorchSide | None
    pipetrain_side: PipetrainSide


def build_chunks(model: GPT2Config, table: ScheduleTable, *, rank: int) -> dict[int, nn.Module]:
    """This rank's chunks keyed by global stage, placed as ``table.placement`` says (loop or V)."""
    ranges = stage_layer_ranges(model.n_layer, table.num_stages)
    last = table.num_stages - 1
    return {
        s: build_chunk(model, layer_range=ranges[s], has_embedding=s == 0, has_head=s == last, seed=SEED)
        for s in range(table.num_stages)
        if table.placement[s] == rank
    }


def zero_grads(chunks: dict[int, nn.Module]) -> None:
    for chunk in chunks.values():
        chunk.zero_grad(set_to_none=True)


def grads(chunks: dict[int, nn.Module]) -> dict[tuple[int, str], torch.Tensor | None]:
    return {
        (s, name): None if p.grad is None else p.grad.detach().clone()
        for s, chunk in chunks.items()
        for name, p in chunk.named_parameters()
    }


def max_grad_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over all gradients; inf when one side has a gradient the other lacks."""
    worst = 0.0
    for key, ga in a.items():
        gb = b[key]
        if ga is None or gb is None:
            if ga is not gb:
                return float("inf")
            continue
        worst = max(worst, (ga - gb).abs().max().item())
    return worst


def all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def loss_on_all_ranks(loss: torch.Tensor | None) -> float:
    """The step loss, known only on the last stage's rank, as a float on every rank."""
    return all_max(float("-inf") if loss is None else loss.item())


def gradient_check(run: PairRun, *, rank: int) -> None:
    """One step of each side from zero gradients; assert equal gradients, print the max difference."""
    zero_grads(run.chunks)
    torch_loss = loss_on_all_ranks(run.torch_side.step())
    torch_grads = grads(run.chunks)
    missing = [key for key, g in torch_grads.items() if g is None]
    assert not missing, f"{run.pair.label}: torch left no gradient on {missing}"
    zero_grads(run.chunks)
    pipetrain_loss = loss_on_all_ranks(run.pipetrain_side.step())
    diff = all_max(max_grad_diff(torch_grads, grads(run.chunks)))
    zero_grads(run.chunks)
    if rank == 0:
        print(
            f"check {run.pair.label}: max |grad diff| = {diff:.2e}, "
            f"loss torch {torch_loss:.6f} pipetrain {pipetrain_loss:.6f}",
            flush=True,
        )
    assert diff <= GRAD_TOLERANCE, f"{run.pair.label}: gradients differ by {diff:.3e} > {GRAD_TOLERANCE}"


def time_steps(step: Callable[[], object], chunks: dict[int, nn.Module], *, warmup: int, steps: int) -> list[float]:
    """Seconds per step (meaningful on rank 0) of ``steps`` timed steps after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        zero_grads(chunks)
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def single_process_costs(model: GPT2Config, batch: Batch, *, warmup: int, steps: int) -> tuple[float, float]:
    """Median (step, forward) seconds of the whole model on one process, the same m microbatches."""
    whole = build_chunk(model, layer_range=(0, model.n_layer), has_embedding=True, has_head=True, seed=SEED)
    step_times, forward_times = [], []
    for i in range(warmup + steps):
        whole.zero_grad(set_to_none=True)
        start = time.perf_counter()
        losses = [
            summed_cross_entropy(whole(x_BT), y_BT) / batch.num_tokens
            for x_BT, y_BT in zip(batch.x_microbatches, batch.y_microbatches, strict=True)
        ]
        forward_end = time.perf_counter()
        torch.stack(losses).sum().backward()
        end = time.perf_counter()
        if i >= warmup:
            step_times.append(end - start)
            forward_times.append(forward_end - start)
    return statistics.median(step_times), statistics.median(forward_times)


def simulated_bubble(table: ScheduleTable, costs: dict[str, float]) -> float:
    """Max-over-ranks bubble the cost model predicts for ``table`` with ``costs`` for the whole model."""
    sim = simulate_rank_share(
        table, forward=costs["F"], backward=costs["B"], backward_input=costs["I"], backward_weight=costs["W"]
    )
    return sim.max_bubble


def build_runs(args: argparse.Namespace, model: GPT2Config, batch: Batch, *, rank: int) -> list[PairRun]:
    runs = []
    for pair in PAIRS:
        if pair.schedule not in args.pairs:
            continue
        if pair.torch_class is None and args.mode == "time":
            continue
        try:
            table = build_schedule(pair.schedule, pp=PP, vpp=pair.vpp, num_microbatches=args.m)
            check(table)
        except ValueError as err:
            # Pure and deterministic, so every rank skips the same pairs.
            if rank == 0:
                print(f"skip {pair.label}: pipetrain cannot build a checked table: {err}", flush=True)
            continue
        chunks = build_chunks(model, table, rank=rank)
        torch_side = None
        if pair.torch_class is not None:
            torch_side = TorchSide(pair, chunks=chunks, num_stages=table.num_stages, batch=batch, model=model)
        if torch_side is not None and torch_side.placement != table.placement:
            raise RuntimeError(
                f"{pair.label}: torch places stages on ranks {torch_side.placement}, "
                f"pipetrain on {table.placement}; the pair would not compare the same layout"
            )
        pipetrain_side = PipetrainSide(table, rank=rank, chunks=chunks, batch=batch, n_embd=model.n_embd)
        runs.append(PairRun(pair, table, chunks, torch_side, pipetrain_side))
    return runs


def measure(runs: list[PairRun], args: argparse.Namespace, *, with_torch: bool) -> dict[str, dict[str, list[float]]]:
    """Per pair label, {"torch": [...], "pipetrain": [...]} step seconds over all rounds."""
    times: dict[str, dict[str, list[float]]] = {run.pair.label: {"torch": [], "pipetrain": []} for run in runs}
    for r in range(args.rounds):
        for run in runs:
            sides = [("pipetrain", run.pipetrain_side.step)]
            if with_torch and run.torch_side is not None:
                sides.insert(0, ("torch", run.torch_side.step))
            if r % 2:
                sides.reverse()
            for name, step in sides:
                times[run.pair.label][name] += time_steps(step, run.chunks, warmup=args.warmup, steps=args.steps)
    return times


def iqr_ms(values: list[float]) -> float:
    if len(values) < 2:
        return float("nan")
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) * 1e3


def report_time(runs: list[PairRun], times: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n{'pair':<56}{'torch ms':>10}{'pipetrain ms':>14}{'ratio':>8}{'IQR ms torch/pipetrain':>25}")
    ratios = []
    for run in runs:
        t_all, p_all = times[run.pair.label]["torch"], times[run.pair.label]["pipetrain"]
        t, p = statistics.median(t_all), statistics.median(p_all)
        ratios.append(p / t)
        spread = f"{iqr_ms(t_all):.1f} / {iqr_ms(p_all):.1f}"
        print(f"{run.pair.label:<56}{t * 1e3:>10.1f}{p * 1e3:>14.1f}{p / t:>8.3f}{spread:>25}")
    print(f"load average: {os.getloadavg()[0]:.2f} (this benchmark alone keeps it near {PP})")
    print(f"worst ratio: {max(ratios) if ratios else float('nan'):.3f}")


def report_efficiency(
    runs: list[PairRun], times: dict[str, dict[str, list[float]]], *, single_step: float, single_forward: float
) -> None:
    backward = single_step - single_forward
    costs = {"F": single_forward, "B": backward, "I": backward / 2, "W": backward / 2}
    print(
        f"\nsingle process: step {single_step * 1e3:.1f} ms (forward {single_forward * 1e3:.1f} ms, "
        f"backward {backward * 1e3:.1f} ms); pp={PP}"
    )
    print(f"{'schedule':<18}{'vpp':>4}{'bubble':>9}{'ideal ms':>10}{'measured ms':>13}{'efficiency':>12}")
    for run in runs:
        bubble = simulated_bubble(run.table, costs)
        ideal = single_step / PP / (1.0 - bubble)
        measured = statistics.median(times[run.pair.label]["pipetrain"])
        print(
            f"{run.pair.schedule:<18}{run.pair.vpp:>4}{bubble:>9.3f}{ideal * 1e3:>10.1f}"
            f"{measured * 1e3:>13.1f}{ideal / measured:>12.3f}"
        )


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PP, timeout=timedelta(seconds=300)
    )
    try:
        model = GPT2Config(
            n_layer=args.layers,
            n_embd=args.d,
            n_head=args.heads,
            vocab_size=args.vocab,
            block_size=args.seq,
            dropout=0.0,
        )
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(SEED))
        batch = Batch(x_BT=tokens[:, :-1], y_BT=tokens[:, 1:], num_microbatches=args.m)
        if rank == 0:
            print(
                f"gpt2 n_layer={args.layers} n_embd={args.d} n_head={args.heads} vocab={args.vocab} seq={args.seq} "
                f"batch={args.batch} m={args.m} pp={PP} fp32, torch {torch.__version__}, 1 thread per rank; "
                f"load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        runs = build_runs(args, model, batch, rank=rank)
        for run in runs:
            if run.torch_side is not None:
                gradient_check(run, rank=rank)
        if args.mode == "time":
            times = measure(runs, args, with_torch=True)
            if rank == 0:
                report_time(runs, times)
        else:
            single_step, single_forward = single_process_costs(model, batch, warmup=args.warmup, steps=args.steps)
            gathered: list[tuple[float, float] | None] = [None] * PP
            dist.all_gather_object(gathered, (single_step, single_forward))
            times = measure(runs, args, with_torch=False)
            if rank == 0:
                report_efficiency(
                    runs,
                    times,
                    single_step=statistics.median(g[0] for g in gathered),
                    single_forward=statistics.median(g[1] for g in gathered),
                )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("time", "efficiency"), default="time")
    names = [p.schedule for p in PAIRS]
    parser.add_argument("--pairs", nargs="+", default=names, choices=names, help="pipetrain schedules to run")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; the side that goes first alternates")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side, pair and round")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side, pair and round")
    parser.add_argument("--layers", type=int, default=8, help="model.n_layer")
    parser.add_argument("--d", type=int, default=256, help="model.n_embd")
    parser.add_argument("--heads", type=int, default=4, help="model.n_head")
    parser.add_argument("--vocab", type=int, default=2048, help="model.vocab_size")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (T)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    parser.add_argument("--m", type=int, default=4, help="microbatches per step")
    args = parser.parse_args()
    if args.batch % args.m:
        parser.error(f"--batch={args.batch} must be a multiple of --m={args.m}")
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    mp.spawn(worker, args=(args, free_port()), nprocs=PP, join=True)


if __name__ == "__main__":
    main()
