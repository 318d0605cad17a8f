"""Launching: picks Lightning's launcher, and refuses impossible set-ups before any process starts.

Starting processes and discovering the cluster stay Lightning's (its launchers and ``ClusterEnvironment``s).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from typing import TYPE_CHECKING, Any, Literal

import torch

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import rank_zero_warn
from ddp_strategy.process import failures

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment


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
    """Every rank, before joining: raise ``ValueError`` unless an external launcher's (torchrun, SLURM, ...: one of
    Lightning's own environments) world size is ``num_nodes * num_processes``, its rank in ``[0, world size)`` and
    local rank in ``[0, num_processes)``. Any other environment (Ray's ``RayLightningEnvironment``, a user's
    ``ClusterEnvironment`` subclass) owns the world and is trusted, as Lightning's ``ddp`` trusts it: its
    ``world_size()`` is the world and its own ``validate_settings`` (which Lightning's launcher calls) checks it."""
    # Lightning's own environments (lightning.fabric..., lightning_fabric..., pytorch_lightning...) are checked
    if not (env.creates_processes_externally and type(env).__module__.startswith(("lightning", "pytorch_lightning"))):
        return
    name, world, rank, local = type(env).__name__, env.world_size(), env.global_rank(), env.local_rank()
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


def check_launch_env(env: ClusterEnvironment, num_nodes: int, num_processes: int) -> None:
    """Check the launch variables ``env`` reads with a bare ``int(...)``, before Lightning does (every rank).

    Only what ``env`` reads, parsed as it parses it, each when set, for Lightning's two classes that read launch
    variables themselves (either namespace; exactly those: a subclass may read its own): ``LightningEnvironment``:
    ``MASTER_PORT``, ``LOCAL_RANK``, ``NODE_RANK`` (else ``GROUP_RANK``); ``TorchElasticEnvironment``:
    ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_PORT``, ``GROUP_RANK`` (one torchrun did not set is
    Lightning's ``KeyError``); others (SLURM, ...): nothing.

    Raises:
        ValueError: a variable is empty, not a whole number, or out of range (a port outside 1..65535, 0
            allowed for a Trainer of one process; a negative rank; ``WORLD_SIZE < 1``; ``NODE_RANK >= num_nodes``);
            the message names the variable and its value.
    """
    elastic = type(env).__name__ == "TorchElasticEnvironment"
    if not elastic and type(env).__name__ != "LightningEnvironment":
        return  # a subclass or another environment (SLURM, ...) reads its own variables
    # Upper bounds against the Trainer (RANK < WORLD_SIZE, LOCAL_RANK < devices) are check_external_world's,
    # which runs before the rendezvous; NODE_RANK is bounded here since a Lightning-launched job skips that.
    node = "NODE_RANK" if not elastic and "NODE_RANK" in os.environ else "GROUP_RANK"
    for name, (low, high, meaning) in {  # name: (lowest, highest or None, what it is)
        "WORLD_SIZE": (1, None, "the number of processes"),
        "RANK": (0, None, "a global rank"),
        "LOCAL_RANK": (0, None, "a rank on this node"),
        node: (0, None, "a node index")
        if elastic
        else (0, num_nodes - 1, f"a node index below Trainer(num_nodes={num_nodes})"),
        "MASTER_PORT": (int(num_nodes * num_processes > 1), 65535, "a TCP port"),  # 0: any free one, alone
    }.items():
        if name not in os.environ or (not elastic and name in ("WORLD_SIZE", "RANK")):
            continue
        raw = os.environ[name]
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"Environment variable {name}={raw!r} {'is not a whole number' if raw.strip() else 'is empty'}."
                f" Set it to an integer (e.g. {name}={29500 if name == 'MASTER_PORT' else 0}) or unset it."
            ) from None
        if value < low or (high is not None and value > high):
            raise ValueError(
                f"Environment variable {name}={raw!r} is out of range: it is {meaning}, so"
                f" {f'{low}..{high}' if high is not None else f'>= {low}'}. Fix the launcher's {name}, or unset it."
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
    else :class:`CheckedMultiProcessingLauncher`; ``ValueError`` for ``"nccl"`` on CPU (a backend's name is checked
    at the join: :func:`~ddp_strategy.process.group.resolve_backend`)."""
    env, devices = strategy.cluster_environment, strategy.parallel_devices
    if backend == "nccl" and devices[0].type != "cuda":
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but this rank runs on {devices[0]}. Use"
            " process_group_backend='gloo' (or None) for CPU training, or Trainer(accelerator='cuda')."
        )
    if devices[0].type == "cpu" and not env.creates_processes_externally:
        check_cpu_processes(strategy.num_processes, allow_cpu_oversubscription)
    if start_method == "popen":
        return _pl.SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)
    return CheckedMultiProcessingLauncher(strategy, start_method=start_method)


class CheckedMultiProcessingLauncher(_pl.MultiProcessingLauncher):
    """Lightning's ``spawn``/``fork``/``forkserver`` launcher, with plain errors, SIGTERM forwarding, and ranks that
    report their failures (``torch.multiprocessing``'s ``ProcessContext.join`` supervises them)."""

    procs: list[torch.multiprocessing.Process]  # Lightning's, set by launch (to mypy the base is a `type`)

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
            failures.destroy_process_group()  # and this process's garbage (collected there), whose finalizers may
            # wait on locks that threads fork does not copy still hold (seen: ranks hung in gc.collect at exit)
        previous = (  # Lightning's kill: the signal to each rank still alive
            signal.signal(signal.SIGTERM, lambda signum, _: self.kill(signum))
            if threading.current_thread() is threading.main_thread()
            else None
        )
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:  # Ctrl-C here leaves the ranks running: stop them (join has stopped them on a failure)
            for proc in self.procs:
                proc.join(30.0)  # after a SIGTERM the ranks save, then exit
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
        try:
            return super()._wrapping_function(process_idx, trainer, function, *rest, **kw)
        except BaseException as exception:
            self._strategy.on_exception(exception)
            if isinstance(exception, SystemExit):
                raise RuntimeError(f"[rank {self._strategy.global_rank}] stopped by SIGTERM") from exception
            raise
        finally:
            failures.destroy_process_group()
