"""``PipelineParallelStrategy``: a Lightning strategy that runs a pipeline schedule.

What it owns (DESIGN.md, contracts 2, 4 and 5):

- the process groups: a ("dp", "pp") device mesh over all processes (gloo on CPU, NCCL on GPU),
  and for GPT-2's tied embedding/head one group holding the first- and last-stage ranks;
- this rank's :class:`StageInfo`, which the LightningModule's ``configure_model`` reads to build
  only its local chunks;
- the task table (built and checked before training starts) and the executor that walks it;
- the cross-rank gradient work of each step: averaging over data-parallel replicas (one
  all-reduce per local stage, started as that stage's last backward ends, see
  :mod:`pipetrain.pipeline.data_parallel`), summing the tied embedding/head gradient, and one
  global gradient norm over all stages for clipping;
- broadcasting the step loss from the last stage so that rank 0's loggers see it, averaged
  over replicas.

Rank order: global rank ``g = dp_rank * pp + pp_rank``. The ranks of one pipeline replica are
adjacent, so with ``pp`` <= processes per node a replica sits on one node: the per-microbatch
point-to-point traffic stays on the node's fast links and only the once-per-step gradient
all-reduce crosses nodes. (Megatron-LM and torchtitan, which add tensor parallelism, order pp
outermost instead.) The groups are printed at start-up.

It subclasses ``ParallelStrategy`` rather than ``DDPStrategy``: DDP would wrap the model and
broadcast rank 0's weights, both wrong when ranks own different layers.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipetrain import checkpoint as ckpt
from pipetrain.pipeline.check import check
from pipetrain.pipeline.comms import P2PComms, PeerError
from pipetrain.pipeline.data_parallel import GradientAverager
from pipetrain.pipeline.executor import PipelineExecutor
from pipetrain.pipeline.partition import StageInfo, partition
from pipetrain.pipeline.schedules import ScheduleTable, build_schedule, gpipe_on, resolve_placement

_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
# Set in the ranks this process starts: their parent's pid, to notice a parent gone before the
# death signal was armed.
_LAUNCHER_PID = "PIPETRAIN_LAUNCHER_PID"


def hydra_job_command(global_rank: int) -> list[str]:
    """The command that starts rank ``global_rank`` of the current Hydra job, and only that job.

    Lightning's own Hydra support re-runs ``sys.argv``: under ``--multirun`` every child would
    run the whole sweep. Here a child gets this job's overrides, its output dir (quoted) and
    ``hydra.mode=RUN``, so sweeps, including ones that set ``hydra.mode: MULTIRUN`` in config,
    start exactly one job per child.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += [f"--config-name={hc.job.config_name}"]
    command += [f"--config-dir={src.path}" for src in hc.runtime.config_sources if src.provider == "command-line"]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name={hc.job.name}_rank{global_rank}",
        "hydra.output_subdir=null",
        "hydra.mode=RUN",
    ]
    return command


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


# Looked up once, in the parent: the child only calls it between fork and exec.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a child before exec: the kernel kills it when the launching rank dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def describe_exit(code: int) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' for a Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankWatcher(threading.Thread):
    """Ends the job when a child rank dies, naming it.

    Polls the child processes every ``poll_s`` seconds. When one ends with a non-zero code it
    prints ``pipetrain: rank R (pid P) was killed by SIGKILL ...`` to stderr (the first child seen
    failing; within one poll a death by signal before an exit code, which is usually a peer
    reacting to it), then gives the surviving ranks ``grace_s`` seconds to fail on their own (a
    peer's death breaks their connections at once, and each reports what it was waiting for).
    Whatever still runs after that is killed; with ``exit_process`` this process then exits with
    code 1, else (a sweep, whose next job must run) its own rank fails by the group timeout.
    A daemon thread: it ends with the job.

    Args:
        procs: the child processes (this node's ranks but the first).
        ranks: their global ranks, in the same order.
        exit_process: end this process after the grace period.
        grace_s: seconds between the report and the forced end.
        poll_s: seconds between polls.
    """

    def __init__(
        self,
        procs: list[subprocess.Popen],
        ranks: list[int],
        *,
        exit_process: bool = True,
        grace_s: float = 15.0,
        poll_s: float = 0.5,
    ):
        super().__init__(daemon=True, name="pipetrain-rank-watcher")
        self.procs, self.ranks = procs, ranks
        self.exit_process = exit_process
        self.grace_s, self.poll_s = grace_s, poll_s
        self.main_failed = False  # set by the strategy when this process's own rank fails first
        self._lock = threading.Lock()
        self._reported = False
        self._first: tuple[int, subprocess.Popen] | None = None
        self._done = threading.Event()

    def _failed(self) -> tuple[int, subprocess.Popen] | None:
        with self._lock:
            if self._first is None:
                codes = [proc.poll() for proc in self.procs]
                failed = [(code >= 0, r, p) for r, p, code in zip(self.ranks, self.procs, codes, strict=True) if code]
                if failed:
                    _, rank, proc = min(failed, key=lambda f: (f[0], f[1]))
                    self._first = (rank, proc)
            return self._first

    def report(self, wait_s: float = 0.0) -> bool:
        """Print which child rank failed (once per job), waiting up to ``wait_s`` for one to end.

        Returns whether a failed child was found.
        """
        deadline = time.monotonic() + wait_s
        while (failed := self._failed()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if failed is None:
            return False
        rank, proc = failed
        with self._lock:
            if not self._reported and not self.main_failed and not self._done.is_set():
                print(
                    f"pipetrain: rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)} during the run; "
                    "ending the job",
                    file=sys.stderr,
                    flush=True,
                )
            self._reported = True
        return True

    def wait_children(self, timeout_s: float) -> list[tuple[int, subprocess.Popen, str]]:
        """At the end of the run (this rank's teardown): wait up to ``timeout_s`` for every child;
        kill those still running. Returns (rank, process, what happened) for each child that did
        not end with code 0. From here on the watcher reports nothing."""
        with self._lock:
            self._done.set()
            self._reported = True
        deadline = time.monotonic() + timeout_s
        bad = []
        for rank, proc in zip(self.ranks, self.procs, strict=True):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                what = describe_exit(proc.returncode)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                what = f"did not end within {timeout_s:g} s and was killed"
            if proc.returncode:
                bad.append((rank, proc, what))
        return bad

    def run(self) -> None:
        while not self._done.is_set() and not self.report():
            if all(proc.poll() == 0 for proc in self.procs):
                return
            time.sleep(self.poll_s)
        if self._done.is_set():
            return
        # Give the surviving ranks time to fail on their own and say what they waited for.
        time.sleep(self.grace_s)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        if self.exit_process and not self._done.is_set():
            print("pipetrain: the job ended because a rank failed", file=sys.stderr, flush=True)
            os._exit(1)


class HydraJobLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess (popen) launcher, made safe for Hydra sweeps and rank failures.

    Children run :func:`hydra_job_command`; :meth:`restore_environment` undoes the launch
    variables (``LOCAL_RANK``, ``MASTER_PORT``, ...) so that the next job of a sweep, in the same
    process, starts its own children on a fresh port instead of waiting for peers that are gone.

    Failures: each child is killed by the kernel if this (rank 0's) process dies
    (``PR_SET_PDEATHSIG``), and a :class:`RankWatcher` ends the job, naming the rank, when a child
    dies. Lightning's own observer is not started: it kills every process silently.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._saved_env: dict[str, str | None] = {}
        self.watcher: RankWatcher | None = None

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from pipetrain.sweep import in_sweep

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            self.watcher = RankWatcher(
                self.procs, list(range(first, first + len(self.procs))), exit_process=not in_sweep()
            )
            self.watcher.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _call_children_scripts(self) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.utils import get_original_cwd

        self._saved_env = {key: os.environ.get(key) for key in _LAUNCH_ENV}
        if not HydraConfig.initialized():
            super()._call_children_scripts()
            return
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        for local_rank in range(1, self.num_processes):
            child_env = {**os.environ, "LOCAL_RANK": str(local_rank), _LAUNCHER_PID: str(os.getpid())}
            global_rank = env.node_rank() * self.num_processes + local_rank
            self.procs.append(
                subprocess.Popen(
                    hydra_job_command(global_rank), env=child_env, cwd=get_original_cwd(), preexec_fn=_die_with_parent
                )
            )

    def restore_environment(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}


class RankFailure(RuntimeError):
    """Another rank of the job died or stopped answering; the message names it."""


def _says_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return any(word in text for word in ("timed out", "timeout", "timing out"))


def _lost_a_peer(exception: BaseException | None) -> bool:
    """Whether ``exception`` (or what caused it) is a failed exchange with another rank.

    gloo reports a dead peer as a plain RuntimeError ("Connection reset by peer", "Connection
    closed by peer"), so the message is read too.
    """
    while exception is not None:
        if isinstance(exception, (PeerError, dist.DistError)):
            return True
        if isinstance(exception, RuntimeError) and (
            _says_timeout(exception) or any(w in str(exception).lower() for w in ("by peer", "connection"))
        ):
            return True
        exception = exception.__cause__ or exception.__context__
    return False


class PipelineParallelStrategy(ParallelStrategy):
    """Pipeline parallelism over ``pp`` processes, times ``dp`` data-parallel replicas.

    Args:
        pp: pipeline-parallel degree (processes in the pipeline).
        vpp: stages per rank.
        dp: data-parallel degree (pipeline replicas, each on its shard of the global batch).
        num_microbatches: microbatches per optimizer step.
        schedule: registered schedule name (``pipetrain.pipeline.schedules.SCHEDULES``) or "csv".
        schedule_path: the CSV file of ``schedule="csv"``.
        n_layer: layers of the model, to partition.
        placement: "auto" (the schedule's own placement), "loop" or "v".
        timeout_s: seconds a collective or p2p op may wait on a peer before the run fails.
        Remaining arguments are Lightning's (filled in by the Trainer when left None).

    Raises:
        ValueError: sizes the schedule or partition cannot run (before any process starts).
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        *,
        pp: int = 1,
        vpp: int = 1,
        dp: int = 1,
        num_microbatches: int = 1,
        schedule: str = "1f1b",
        n_layer: int = 1,
        placement: str = "auto",
        schedule_path: str | None = None,
        timeout_s: float = 300.0,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: str | None = None,
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.pp, self.vpp, self.dp = pp, vpp, dp
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.placement = placement
        self._timeout = timedelta(seconds=timeout_s)
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        # Pure and cheap: build and check everything before any process group exists.
        self.table: ScheduleTable = build_schedule(
            schedule, pp=pp, vpp=vpp, num_microbatches=num_microbatches, path=schedule_path
        )
        check(self.table)
        self.stage_infos: tuple[StageInfo, ...] = partition(
            n_layer, pp=pp, vpp=vpp, placement=resolve_placement(self.table, placement)
        )
        # Validation runs GPipe's forwards over the training table's placement.
        self.eval_table: ScheduleTable = gpipe_on(self.table)
        check(self.eval_table)
        self.mesh: DeviceMesh | None = None
        self._tied_group: dist.ProcessGroup | None = None
        self._executors: dict = {}
        self.train_executor: PipelineExecutor | None = None
        self._loaded: tuple | None = None
        self._failed = False

    # ------------------------------------------------------------------ Lightning plumbing

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every pp rank of a replica reads the same batches; the data module shards by dp rank.
        return {"num_replicas": self.dp, "rank": self.dp_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        launcher_pid = os.environ.pop(_LAUNCHER_PID, None)  # not for what this rank starts
        if launcher_pid and os.getppid() != int(launcher_pid):
            raise RankFailure(f"the process that started this rank (pid {launcher_pid}, rank 0) is gone")
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        if self.world_size != self.dp * self.pp:
            raise ValueError(
                f"the run has {self.world_size} processes but parallel.dp * parallel.pp = {self.dp * self.pp}; "
                "launch exactly dp * pp processes"
            )
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)

        # Every group gets parallel.timeout_s: device-mesh subgroups and new_group would otherwise
        # take torch's defaults (30 min on gloo, 10 on NCCL) whatever the default group has.
        # One options object per group: NCCL writes each group's split details into its own.
        # A dimension spanning the whole world reuses the default group, which has the timeout.
        def options() -> tuple[str, Any]:
            opts = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            return backend, opts

        sizes = {"dp": self.dp, "pp": self.pp}
        self.mesh = init_device_mesh(
            self.root_device.type,
            (self.dp, self.pp),
            mesh_dim_names=("dp", "pp"),
            backend_override={dim: options() for dim, size in sizes.items() if 1 < size < self.world_size},
        )
        if self.global_rank == 0:
            grid = self.mesh.mesh.tolist()
            print(
                f"pipetrain: device mesh (dp={self.dp}, pp={self.pp}), {self._process_group_backend}: "
                f"pp groups {grid}, dp groups {[list(col) for col in zip(*grid, strict=True)]}",
                flush=True,
            )
        # new_group is collective: every rank creates every replica's tied group, keeps its own.
        for d in range(self.dp):
            ranks = sorted({d * self.pp + self.table.placement[0], d * self.pp + self.table.placement[-1]})
            group = dist.new_group(ranks=ranks, timeout=self._timeout) if len(ranks) > 1 else None
            if self.global_rank in ranks:
                self._tied_group = group

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not _distributed_is_initialized():
            return tensor
        tensor = tensor.clone()
        op = dist.ReduceOp.SUM
        dist.all_reduce(tensor, op=op, group=group)
        if reduce_op in ("mean", "avg", dist.ReduceOp.AVG):
            tensor = tensor / dist.get_world_size(group)
        return tensor

    def on_train_start(self) -> None:
        super().on_train_start()
        # SIGTERM (preemption, scancel, torchrun stopping its workers) ends this process at once.
        # Lightning's handler would instead broadcast a flag from inside the signal handler, a
        # collective that meets the pipeline's own in the wrong order and hangs the ranks. The
        # last completed checkpoint is intact (saves are atomic); ranks started by this process
        # die with it.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def on_exception(self, exception: BaseException) -> None:
        # This rank failed on its own (not because a peer went away): the children that fail
        # after it are not the cause, and the watcher does not name them.
        self._failed = True
        watcher = self._launcher.watcher if isinstance(self._launcher, HydraJobLauncher) else None
        if watcher is None:
            return
        if _lost_a_peer(exception):
            watcher.report(wait_s=3.0)  # a child's death is what broke the connection: name it
        else:
            watcher.main_failed = True

    def teardown(self) -> None:
        super().teardown()
        watcher = self._launcher.watcher if isinstance(self._launcher, HydraJobLauncher) else None
        failures = []
        if watcher is not None and self._failed:
            # This rank failed: its children fail too (or are waiting for it). Give them a moment
            # to say why, then end them, so that a sweep's next job starts with no rank left over.
            watcher.wait_children(10.0)
        elif watcher is not None:
            # A successful run ends when every rank has: a child still writing (its parameter
            # dump, its logs) finishes, and one that failed after the fit is reported. The
            # groups live until then (the children's store is this process's).
            failures = watcher.wait_children(self._timeout.total_seconds())
        # Leave the process clean for the next job of a sweep: no group, no launch variables.
        if _distributed_is_initialized():
            dist.destroy_process_group()
        if isinstance(self._launcher, HydraJobLauncher):
            self._launcher.restore_environment()
        self.mesh = None
        self._tied_group = None
        self._executors.clear()
        self.train_executor = None
        if failures:
            raise RankFailure(
                "; ".join(f"rank {rank} (pid {proc.pid}) {what}" for rank, proc, what in failures)
                + " at the end of the run"
            )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="pipetrain pipeline parallelism")

    # ------------------------------------------------------------------ checkpoints

    def layout(self) -> dict[str, Any]:
        """The parallel layout, as recorded in a checkpoint (its RNG states apply only to the same)."""
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "dp": self.dp,
            "schedule": self.schedule_name,
            "placement": list(self.table.placement),
        }

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Parameters are written by save_checkpoint through DCP, by global name; Lightning's
        # dict would key them by local chunk.
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint directory (collective: every rank writes what it owns).

        Layout and contents: :mod:`pipetrain.checkpoint`. All is written under a temporary name
        and renamed into place by global rank 0 once every rank is done.
        """
        import torch.distributed.checkpoint as dcp

        final = Path(filepath)
        partial = ckpt.partial_path(final)
        if self.is_global_zero:
            shutil.rmtree(partial, ignore_errors=True)
        self.barrier()
        partial.mkdir(parents=True, exist_ok=True)
        module = self.lightning_module
        params = module.named_global_parameters()
        optimizer = self.optimizers[0]
        dcp.save(ckpt.tensors_to_save(params, optimizer), checkpoint_id=str(partial))
        ckpt.save_synced(ckpt.rng_state(), partial / ckpt.rng_file(self.global_rank))
        if self.is_global_zero:
            state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            state["pipetrain"] = {
                "format": ckpt.FORMAT_VERSION,
                "layout": self.layout(),
                "param_groups": ckpt.optimizer_hyperparameters(optimizer),
            }
            ckpt.save_synced(state, partial / ckpt.TRAINER_STATE_FILE)
        self.barrier()
        if self.is_global_zero:
            ckpt.replace_dir(partial, final)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint saved at any layout into this rank's chunks (collective).

        The parameters are loaded in place here; the optimizer state waits in buffers for
        :meth:`load_optimizer_state_dict`. Returns Lightning's part of the checkpoint.

        Raises:
            pipetrain.checkpoint.CheckpointError: the checkpoint does not fit the model (keys named).
        """
        import torch.distributed.checkpoint as dcp

        path = Path(checkpoint_path)
        state = ckpt.read_trainer_state(path)
        module = self.lightning_module
        ckpt.check_fits(path, module.model_cfg)
        params = module.named_global_parameters()
        plan = ckpt.LoadPlan(path, params=params, aliases=ckpt.tied_aliases(module.model_cfg))
        dcp.load(plan.request, checkpoint_id=str(path))
        self._loaded = (plan, params, state["pipetrain"]["param_groups"])
        if state["pipetrain"]["layout"] == self.layout():
            state["rng"] = torch.load(path / ckpt.rng_file(self.global_rank), weights_only=True)
        return {**state, "state_dict": {}, "optimizer_states": [{}]}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, by global name

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        plan, params, groups = self._loaded
        optimizer = self.optimizers[0]
        optimizer.load_state_dict(plan.optimizer_state_dict(optimizer, params=params, hyperparameters=groups))
        self._loaded = None

    # ------------------------------------------------------------------ pipeline facts

    @property
    def pp_rank(self) -> int:
        return self.global_rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.pp

    @property
    def stage_info(self) -> StageInfo:
        return self.stage_infos[self.pp_rank]

    def _pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("pp") if self.mesh is not None and self.pp > 1 else None

    def _dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp") if self.mesh is not None and self.dp > 1 else None

    def _last_stage_global_rank(self) -> int:
        return self.dp_rank * self.pp + self.table.placement[-1]

    # ------------------------------------------------------------------ running a step

    @contextmanager
    def _naming_failures(self, what: str, group: dist.ProcessGroup | None):
        """Turn a communication that failed because a peer is gone into a RankFailure naming the
        peer (a receive knows it: :class:`PeerError`) or else the group."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, RankFailure) or not _lost_a_peer(err):
                raise
            if isinstance(err, PeerError):
                lost = self.dp_rank * self.pp + err.peer
                why = self._why_lost(err.__cause__ or err, "it")
                raise RankFailure(
                    f"rank {self.global_rank} lost rank {lost} (pp rank {err.peer} of replica {self.dp_rank}): "
                    f"{why}. {err}"
                ) from err
            ranks = dist.get_process_group_ranks(group) if group is not None else []
            why = self._why_lost(err, "one of them")
            raise RankFailure(f"rank {self.global_rank}: {what} with ranks {ranks} failed: {why}. {err}") from err

    def _why_lost(self, err: BaseException, who: str) -> str:
        if _says_timeout(err):
            return f"{who} did not answer within parallel.timeout_s={self._timeout.total_seconds():g}"
        return f"{who} closed its connection (its process ended)"

    def run_schedule(
        self,
        chunks: dict[int, nn.Module],
        batch_BT1: torch.Tensor,
        *,
        hidden_dim: int,
        comm_dtype: torch.dtype,
        train: bool,
    ) -> torch.Tensor:
        """Run one step's schedule on this rank and return the step loss on every rank.

        Args:
            chunks: this rank's chunks keyed by global stage index.
            batch_BT1: this replica's token rows for the step, (rows, T + 1) int64; rows must
                be a multiple of num_microbatches.
            hidden_dim: C (n_embd), the width of the activations sent between stages.
            comm_dtype: dtype of the activations and gradients on the wire.
            train: run the training table (forwards and backwards) or, when False, only
                forwards (validation; call under torch.no_grad()).

        Returns:
            0-dim fp32 tensor: mean token loss over the step's global batch (all replicas),
            identical on all ranks. After a training step every local gradient is the replicas'
            average.
        """
        rows, t_plus_1 = batch_BT1.shape
        m = self.num_microbatches
        if rows % m:
            raise ValueError(f"a batch of {rows} rows cannot be cut into parallel.num_microbatches={m} microbatches")
        inputs = batch_BT1[:, :-1].split(rows // m)
        targets = batch_BT1[:, 1:].split(rows // m)
        hidden_shape = (rows // m, t_plus_1 - 1, hidden_dim)
        key = (train, hidden_shape, comm_dtype)
        entry = self._executors.get(key)
        if entry is None:
            # One executor per table and message shape: it lowers the table once, not every step.
            comms = P2PComms(group=self._pp_group(), rank=self.pp_rank, device=self.root_device, dtype=comm_dtype)
            executor = PipelineExecutor(
                self.table if train else self.eval_table,
                rank=self.pp_rank,
                chunks=chunks,
                comms=comms,
                hidden_shape=hidden_shape,
            )
            averager = None
            if train and self.dp > 1:
                averager = GradientAverager(
                    group=self._dp_group(),
                    dp=self.dp,
                    stage_params={s: chunk.parameters() for s, chunk in chunks.items()},
                    ready_order=executor.grads_ready_order,
                )
                executor.on_grads_ready = averager.launch
            entry = self._executors[key] = (executor, averager)
        executor, averager = entry
        if train:
            self.train_executor = executor
        with self._naming_failures("the pipeline's messages", self._pp_group()):
            loss = executor.run(inputs, targets=targets, num_tokens=rows * (t_plus_1 - 1), forward_only=not train)
        if averager is not None:
            with self._naming_failures("the gradient all-reduce", self._dp_group()):
                averager.finish()
        if loss is None:
            loss = torch.zeros((), dtype=torch.float32, device=self.root_device)
        if self.pp > 1:
            with self._naming_failures("the loss broadcast", self._pp_group()):
                dist.broadcast(loss, src=self._last_stage_global_rank(), group=self._pp_group())
        if self.dp > 1:
            # Every replica's loss is the mean over its equal share of the tokens.
            with self._naming_failures("the loss all-reduce", self._dp_group()):
                dist.all_reduce(loss, group=self._dp_group())
            loss = loss / self.dp
        return loss

    def gather_pipeline(self, obj: Any) -> list[Any] | None:
        """Collect ``obj`` from every pp rank of this replica: the list (index = pp rank) on the
        replica's pp rank 0, None elsewhere. Collective over the pp group."""
        if self.pp == 1:
            return [obj]
        out = [None] * self.pp if self.pp_rank == 0 else None
        dist.gather_object(obj, out, group=self._pp_group(), group_dst=0)
        return out

    def sync_tied_gradients(self, tied: list[tuple[nn.Parameter | None, nn.Parameter | None]]) -> None:
        """Sum the gradients of tied weights held on different ranks (first and last stage).

        Collective over the tied group: the first- and last-stage ranks must call it with their
        pairs in the same order (the model family's ``tied_weights`` order).

        Args:
            tied: per tied pair, (embedding-side parameter or None, head-side parameter or None)
                as held on this rank. A rank holding both shares one Parameter: nothing to do.
        """
        if self._tied_group is None:
            return
        for emb, head in tied:
            # pp > 1: a rank in the tied group holds exactly one side of the pair.
            p = emb if emb is not None else head
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            with self._naming_failures("the tied-weight gradient all-reduce", self._tied_group):
                dist.all_reduce(p.grad, group=self._tied_group)

    def clip_grad_norm(
        self, params: list[nn.Parameter], max_norm: float | None, *, norm_params: list[nn.Parameter]
    ) -> torch.Tensor:
        """One global L2 norm over all stages' gradients; scale every local gradient by it.

        Args:
            params: all of this rank's parameters: every one of them is clipped.
            max_norm: clip threshold, or None to only measure.
            norm_params: the subset that enters the norm, each weight counted once across the
                pipeline (a tied head copy held away from its embedding is left out: its
                gradient equals the embedding's, which the first rank already counts).

        Returns:
            The global gradient norm before clipping (0-dim fp32 tensor), the same on all ranks.
        """
        # fp32 accumulation even for bf16 gradients; a no-op view for fp32 ones.
        grads = [p.grad.float() for p in norm_params if p.grad is not None]
        local_sq = (
            torch.nn.utils.get_total_norm(grads, norm_type=2.0).float() ** 2
            if grads
            else torch.zeros((), device=self.root_device)
        )
        if self.pp > 1:
            with self._naming_failures("the gradient-norm all-reduce", self._pp_group()):
                dist.all_reduce(local_sq, group=self._pp_group())
        total = local_sq.sqrt()
        if max_norm is not None and math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
        return total


PipelineParallelStrategy.register_strategies(StrategyRegistry)
