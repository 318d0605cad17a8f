"""Launching: picks Lightning's launcher, and refuses impossible set-ups before any process starts.

Starting processes and discovering the cluster stay Lightning's (its launchers and ``ClusterEnvironment``s).
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat.namespace import rank_zero_warn
from ddp_strategy.process import failures
from ddp_strategy.process.group import resolve_backend

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment

#: Lightning's cluster environments of either namespace, for isinstance checks.
LightningEnvironment = _namespace.any_namespace("fabric.plugins.environments:LightningEnvironment")
TorchElasticEnvironment = _namespace.any_namespace("fabric.plugins.environments:TorchElasticEnvironment")


StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
#: How ``MyDDPStrategy`` can start its processes.
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")


def default_start_method() -> StartMethod:
    """``"fork"`` in an interactive session (Jupyter, REPL), where a script cannot be re-run; else ``"popen"``
    (Lightning's default for ``"ddp"``: nothing is pickled, and CUDA may be initialised in the parent)."""
    return "fork" if _pl.is_interactive() else "popen"


def check_cpu_processes(num_processes: int, allow_oversubscription: bool = False) -> None:
    """Warn (rank 0) when more CPU processes per node are asked for than this process has cores: slower, not wrong
    (Lightning runs them too), so not refused; ``allow_oversubscription=True`` silences it."""
    cores = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if num_processes > cores and not allow_oversubscription:
        rank_zero_warn(
            f"Trainer(devices={num_processes}) on CPU starts {num_processes} processes, but only {cores} CPU"
            f" cores are available to this process: the processes share the cores, so each step is slower than"
            f" with devices={cores} (results are the same). Pass devices={cores} or fewer for speed, or"
            " MyDDPStrategy(allow_cpu_oversubscription=True) to silence this warning."
        )


def check_external_world(env: ClusterEnvironment, num_nodes: int, num_processes: int) -> None:
    """Every rank, before joining: raise ``ValueError`` unless an external launcher's (torchrun, SLURM) world size is
    ``num_nodes * num_processes``, its rank in ``[0, world size)`` and local rank in ``[0, num_processes)``."""
    if not env.creates_processes_externally:
        return
    name = type(env).__name__
    world, rank, local = env.world_size(), env.global_rank(), env.local_rank()
    if world != num_nodes * num_processes:
        raise ValueError(
            f"[rank {rank}] {name} reports WORLD_SIZE={world}, but Trainer(num_nodes={num_nodes},"
            f" devices={num_processes}) expects {num_nodes * num_processes} processes. Make num_nodes x devices"
            f" equal the launcher's world size (for torchrun: --nnodes x --nproc-per-node)."
        )
    if not 0 <= rank < world:
        raise ValueError(
            f"{name} reports RANK={rank}, outside [0, WORLD_SIZE={world}). Check the launcher's"
            " RANK and WORLD_SIZE variables."
        )
    if not 0 <= local < num_processes:
        raise ValueError(
            f"[rank {rank}] {name} reports LOCAL_RANK={local}, but Trainer(devices={num_processes})"
            " has only that many processes per node. Check --nproc-per-node and devices."
        )


def check_launch_env(
    env: ClusterEnvironment,
    num_nodes: int,
    num_processes: int,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Check the launch variables ``env`` reads with a bare ``int(...)``, before Lightning does (every rank).

    Only what ``env`` reads, parsed as it parses it: ``LightningEnvironment`` (exactly): ``MASTER_PORT``,
    ``LOCAL_RANK``, ``NODE_RANK`` (else ``GROUP_RANK``) when set; ``TorchElasticEnvironment``: ``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``, and ``MASTER_PORT``, ``GROUP_RANK`` when set; others (SLURM, ...): nothing.
    ``environ`` defaults to ``os.environ``.

    Raises:
        ValueError: a variable is empty, not a whole number, or out of range (a port outside 1..65535, 0
            allowed for one process; a negative rank; ``WORLD_SIZE < 1``; ``NODE_RANK >= num_nodes``); the
            message names the variable and its value.
    """
    environ = os.environ if environ is None else environ
    elastic = isinstance(env, TorchElasticEnvironment)
    if not elastic and not (type(env).__name__ == "LightningEnvironment" and isinstance(env, LightningEnvironment)):
        return  # a subclass or another environment (SLURM, ...) reads its own variables
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if elastic else ():
        if name not in environ:
            raise ValueError(
                f"{type(env).__name__} needs the environment variable {name}, which is not set;"
                " launch with torchrun (it sets WORLD_SIZE, RANK and LOCAL_RANK) or set it."
            )
    # Upper bounds against the Trainer (RANK < WORLD_SIZE, LOCAL_RANK < devices) are check_external_world's,
    # which runs before the rendezvous; NODE_RANK is bounded here since a Lightning-launched job skips that.
    node = "NODE_RANK" if not elastic and "NODE_RANK" in environ else "GROUP_RANK"
    limits = {  # name: (lowest, highest or None, what it is); WORLD_SIZE first, as MASTER_PORT's lowest needs it
        "WORLD_SIZE": (1, None, "the number of processes"),
        "RANK": (0, None, "a global rank"),
        "LOCAL_RANK": (0, None, "a rank on this node"),
        node: (0, None, "a node index")
        if elastic
        else (0, num_nodes - 1, f"a node index below Trainer(num_nodes={num_nodes})"),
        "MASTER_PORT": (0, 65535, "a TCP port"),
    }
    world = num_nodes * num_processes
    for name, (low, high, meaning) in limits.items():
        if name not in environ or (not elastic and name in ("WORLD_SIZE", "RANK")):
            continue
        raw = environ[name]
        try:
            value = int(raw)
        except ValueError:
            what = "is empty" if not raw.strip() else "is not a whole number"
            raise ValueError(
                f"Environment variable {name}={raw!r} {what}. Set it to an integer (e.g. {name}="
                f"{29500 if name == 'MASTER_PORT' else 0}) or unset it."
            ) from None
        world = value if name == "WORLD_SIZE" else world
        low = int(world > 1) if name == "MASTER_PORT" else low
        if value < low or (high is not None and value > high):
            bounds = f"{low}..{high}" if high is not None else f">= {low}"
            raise ValueError(
                f"Environment variable {name}={raw!r} is out of range: it is {meaning}, so {bounds}. Fix the"
                f" launcher's {name}, or unset it."
            )


def check_fork_safe(start_method: str, device_type: str) -> None:
    """In the parent: ``RuntimeError`` for ``fork`` of CUDA ranks once CUDA is initialised here (Lightning's own check
    fires only inside the child)."""
    if start_method == "fork" and device_type == "cuda" and torch.cuda.is_initialized():
        raise RuntimeError(
            "start_method='fork' cannot start CUDA ranks: CUDA is already initialised in this process (a"
            " tensor or model was moved to the GPU, or torch.cuda was queried for memory, before fit). Restart"
            " the kernel and keep CUDA work inside the LightningModule, or use start_method='spawn' or 'popen'"
            " (run a script)."
        )


def make_launcher(strategy: Any, start_method: str, backend: str | None, allow_cpu_oversubscription: bool) -> Any:
    """``_compat``'s ``SubprocessScriptLauncher`` (Lightning's, with one supervisor of its ranks) for ``"popen"``,
    else :class:`CheckedMultiProcessingLauncher`; ``ValueError`` for a backend the device cannot use (``"nccl"`` on
    CPU)."""
    env, devices = strategy.cluster_environment, strategy.parallel_devices
    resolve_backend(devices[0], backend)
    if devices[0].type == "cpu" and not env.creates_processes_externally:
        check_cpu_processes(strategy.num_processes, allow_cpu_oversubscription)
    if start_method != "popen":
        return CheckedMultiProcessingLauncher(strategy, start_method=start_method)
    return _pl.SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


class CheckedMultiProcessingLauncher(_pl.MultiProcessingLauncher):
    """Lightning's ``spawn``/``fork``/``forkserver`` launcher, with plain errors, SIGTERM forwarding, and ranks that
    report their failures (``torch.multiprocessing``'s ``ProcessContext.join`` supervises them)."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Check CUDA (``fork``) and picklability (``spawn``, ``forkserver``: else ``RuntimeError``), then launch as
        Lightning does, passing a SIGTERM on to the ranks (else orphans train on); then close the ``Process``
        objects (through the Trainer they form a cycle holding ~4 descriptors per fit)."""
        check_fork_safe(self._start_method, self._strategy.root_device.type)
        for obj in (*args, *kwargs.values()) if self._start_method in ("spawn", "forkserver") else ():
            try:
                pickle.dumps(obj)
            except Exception as e:  # pickling raises many types: PicklingError, AttributeError, TypeError
                raise RuntimeError(
                    f"start_method={self._start_method!r} must pickle {type(obj).__name__} to send it to each"
                    f" process, but it cannot be pickled: {e}. Define your classes and functions at module"
                    " level (not inside a function or notebook cell) and avoid lambdas, or use"
                    " start_method='popen' (running a script) or 'fork' (Linux, notebooks)."
                ) from e
        if self._start_method == "fork":  # a forked rank would inherit this process's group, without gloo's threads,
            failures.destroy_process_group()  # and this process's garbage, whose finalizers may wait on locks
            gc.collect()  # that threads fork does not copy still hold (seen: ranks hung in gc.collect at exit)
        received: list[int] = []

        def forward(signum: int, frame: Any) -> None:
            received.append(signum)
            self.kill(signum)  # Lightning's: the signal to each rank still alive

        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, forward) if main else None
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:  # Ctrl-C here leaves the ranks running: stop them (join has stopped them on a failure)
            deadline = time.monotonic() + (30.0 if received else 3.0)  # a SIGTERM: the ranks save, then exit
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                proc.kill()  # a no-op once it exited
                proc.join()
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            procs, self.procs = self.procs, []
            for proc in procs:
                if not proc.is_alive():
                    proc.close()

    def _wrapping_function(self, process_idx: int, trainer: Any, function: Any, *rest: Any, **kw: Any) -> None:
        """In each rank: Lightning's worker, with the strategy's ``on_exception`` on failure (Lightning calls it only
        in the parent) and the group destroyed at the end; a SIGTERM stop is raised as an error, not Lightning's
        ``SystemExit``, so the parent does not wait for results that will not come."""
        strategy = self._strategy

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except BaseException as exception:
                strategy.on_exception(exception)
                if isinstance(exception, SystemExit):
                    raise RuntimeError(f"[rank {strategy.global_rank}] stopped by SIGTERM") from exception
                raise

        try:
            return super()._wrapping_function(process_idx, trainer, guarded, *rest, **kw)
        finally:
            failures.destroy_process_group()
