"""Real trainings without a fresh interpreter each: one process runs in the test's own process, N ranks in a pool
of N worker processes started once per test session; and a session cache of reference runs.

Why: a launch (``launch.py``) spends ~10 s per process importing torch, transformers and the recipe before its
first step, and the suite's trainings are a few steps each, so imports were most of the suite's time. A pool worker
is forked from the session's fork server, which imported the kit and the recipes once (``start_fork_server``: the
session's conftest starts it when it collects the first test that starts processes, so it imports during
collection), and then runs each requested training as a launched rank would: the environment torchrun sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, a fresh ``MASTER_PORT``), accelerate's state reset, the run's own
process group set up and torn down by ``run_recipe``, one torch thread. What a run returns is what a launch
returns (exit status, stdout, stderr), so a test reads either the same way. A run a test signals or kills mid-way
(``start_forked``) is forked from the same server, its ranks processes of their own. Real launches stay where the
launcher or the interpreter is the point: a launcher's own behaviour, the command line, the interpreter's exit.

Every training is counted (``launch.RUN_COUNTS``); the session prints the counts at its end.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout, suppress
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..device import DEVICE_ENV
from .launch import KIT_OVERRIDES, LAUNCH_ENV, RUN_COUNTS, count_launch

POOL_START_TIMEOUT = 120.0
# what a pooled rank would import before its first call, imported once by the fork server its workers fork from
# (a module that does not import is left to the worker, as multiprocessing's preload does): the kit, the entry
# point, every recipe's train module and what compiling flex attention imports
POOL_PRELOAD = ["mvp_engine.engine.testkit", "mvp_engine.engine.entry",
                *sorted(f"recipes.{path.parent.name}.train"
                        for path in (Path(__file__).resolve().parents[3] / "recipes").glob("*/train.py")),
                "torch._inductor.compile_fx", "torch.nn.attention.flex_attention",
                "transformers.integrations.flex_attention"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _as_launched():
    """As a launch runs (``LAUNCH_ENV``): one torch thread and the CPU, so results do not depend on the cores free
    or on a GPU being present, and an in-process reference computes what a launched or pooled run computes."""
    before, device = torch.get_num_threads(), os.environ.get(DEVICE_ENV)
    torch.set_num_threads(1)
    os.environ[DEVICE_ENV] = LAUNCH_ENV[DEVICE_ENV]
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if device is None:
            os.environ.pop(DEVICE_ENV, None)
        else:
            os.environ[DEVICE_ENV] = device


def _entry_config(recipe: str, run_dir: str, overrides: Sequence[str], first: Sequence[str] = ()):
    """The config an entry point's command line composes for a run writing to ``run_dir``, with the kit's launch
    overrides; accelerate's state of the last run in this process (its process group is gone) dropped."""
    from accelerate.state import AcceleratorState

    from .structure import compose_config

    AcceleratorState._reset_state(reset_partial_state=True)
    return compose_config(recipe, [*first, f"train.output_dir={run_dir}", *KIT_OVERRIDES, *overrides])


def _train_job(recipe: str, run_dir: str, overrides: Sequence[str]) -> None:
    """One run of ``recipes.<recipe>.train`` with ``overrides`` writing to ``run_dir``, as its command line would
    run it (``run_recipe``: a config or data error is one stderr line and exit status 1)."""
    from ..entry import run_recipe
    from .structure import load_recipe

    run_recipe(_entry_config(recipe, run_dir, overrides), load_recipe(recipe))


def evaluate_job(rank: int, recipe: str, run_dir: str, overrides: Sequence[str]) -> None:
    """One rank of ``recipes.<recipe>.evaluate`` with ``overrides`` writing to ``run_dir``, as its command line
    would run it (for ``run_on_ranks``: its ranks are torchrun's, not fresh interpreters)."""
    from ..evaluate import JOB_NAME, evaluate_recipe
    from .structure import load_recipe

    evaluate_recipe(_entry_config(recipe, run_dir, overrides, [f"hydra.job.name={JOB_NAME}"]), load_recipe(recipe))


def _call(target: str, args: tuple, log: Path) -> tuple[int, object, str, str]:
    """``target`` (``module:function``) called with ``args`` as a launched process would run it: (exit status,
    return value, stdout, stderr); a raised exception is status 1 with its traceback on stderr. The outputs go to
    ``log`` + ``.out`` / ``.err`` as they are written, where a call that hangs can still be read (with its threads'
    stacks, dumped on SIGUSR1). Compiled kernels of an earlier call are dropped, as a fresh process has none."""
    module, name = target.split(":")
    torch._dynamo.reset()
    status, value = 0, None
    out_path, err_path = Path(f"{log}.out"), Path(f"{log}.err")
    with open(out_path, "w", buffering=1) as out, open(err_path, "w", buffering=1) as err:
        faulthandler.register(signal.SIGUSR1, file=err, all_threads=True)
        try:
            with redirect_stdout(out), redirect_stderr(err), _as_launched():
                try:
                    value = getattr(importlib.import_module(module), name)(*args)
                except SystemExit as stop:
                    status = stop.code if isinstance(stop.code, int) else 1
                except BaseException:  # noqa: BLE001 - reported as a launch reports a crash: status 1 and the traceback
                    traceback.print_exc()
                    status = 1
        finally:
            faulthandler.unregister(signal.SIGUSR1)
    return status, value, out_path.read_text(), err_path.read_text()


def _exit_with_parent(parent: int) -> None:
    """A worker outliving its test session exits instead of waiting forever for work: its parent, the fork server,
    ends with the session (killed or not), and the worker is then handed to another parent."""
    while True:
        time.sleep(2)
        if os.getppid() != parent:
            os._exit(1)


def _worker(rank: int, nproc: int, environ: dict, jobs, results) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    # the session's environment when the pool started (a spawned worker's own), not the fork server's
    os.environ.clear()
    os.environ.update(environ)
    # a spawned process inherits "spawn" as its default start method; a launched rank's DataLoader workers fork
    multiprocessing.set_start_method("fork", force=True)
    while (job := jobs.get()) is not None:
        target, args, with_rank, port, log = job
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        results.put((rank, *_call(target, (rank, *args) if with_rank else args, Path(f"{log}.rank{rank}"))))


@contextmanager
def _launch_env():
    """``LAUNCH_ENV`` set while processes start (one thread per process, unbuffered output), then as it was."""
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    os.environ.update(LAUNCH_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_fork_server() -> None:
    """Start the session's fork server, if it is not running, without waiting for it: it imports
    ``POOL_PRELOAD`` in the background, and every pool worker is forked from it, ready, instead of a fresh
    interpreter importing torch, transformers and the engine again. Started with ``LAUNCH_ENV``, read at import
    time (OpenMP's thread count)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(POOL_PRELOAD)
    with _launch_env():
        multiprocessing.forkserver.ensure_running()


class RankPool:
    """``nproc`` worker processes, each one rank of every multi-rank run asked of it."""

    def __init__(self, nproc: int):
        start_fork_server()
        context = mp.get_context("forkserver")
        self.nproc = nproc
        self.results = context.Queue()
        self.jobs = [context.Queue() for _ in range(nproc)]
        environ = {**os.environ, **LAUNCH_ENV}
        # not daemonic: a rank's DataLoader workers are its children
        self.workers = [context.Process(target=_worker, args=(rank, nproc, environ, self.jobs[rank], self.results))
                        for rank in range(nproc)]
        for worker in self.workers:
            worker.start()

    def alive(self) -> bool:
        return all(worker.is_alive() for worker in self.workers)

    def run(self, target: str, args: tuple, timeout: float, log: Path, with_rank: bool = False) -> list[tuple]:
        """``target`` called with ``args`` (after the rank, ``with_rank``) on every rank: each rank's (status,
        value, stdout, stderr), in rank order; raises after ``timeout`` with what the ranks still running had
        written and where they were (the pool is stopped)."""
        port = _free_port()
        for queue in self.jobs:
            queue.put((target, args, with_rank, port, str(log)))
        done: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.nproc:
            try:
                rank, *result = self.results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                done[rank] = tuple(result)
            except Exception:  # noqa: BLE001 - queue.Empty: check the deadline and the workers
                if time.monotonic() > deadline or not self.alive():
                    stuck = self._dump_stuck(done, log)
                    self.stop()
                    raise AssertionError(f"{self.nproc}-rank call of {target}{args} did not finish in {timeout} s "
                                         f"(or a rank died); ranks done: {sorted(done)}\n{stuck}") from None
        return [done[rank] for rank in range(self.nproc)]

    def _dump_stuck(self, done: dict, log: Path) -> str:
        """The tails of what each rank not done wrote, its threads' stacks included (SIGUSR1: faulthandler)."""
        for rank, worker in enumerate(self.workers):
            if rank not in done and worker.is_alive():
                os.kill(worker.pid, signal.SIGUSR1)
        time.sleep(2)
        tails = []
        for rank in range(self.nproc):
            for suffix in (".out", ".err"):
                path = Path(f"{log}.rank{rank}{suffix}")
                if rank not in done and path.is_file():
                    tails.append(f"--- rank {rank} {suffix[1:]} ---\n{path.read_text()[-4000:]}")
        return "\n".join(tails)

    def stop(self) -> None:
        for queue, worker in zip(self.jobs, self.workers):
            if worker.is_alive():
                try:
                    queue.put(None)
                except (OSError, ValueError):
                    pass
        for worker in self.workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()


_POOLS: dict[int, RankPool] = {}


def _pool(nproc: int) -> RankPool:
    pool = _POOLS.get(nproc)
    if pool is None or not pool.alive():
        pool = _POOLS[nproc] = RankPool(nproc)
    return pool


@atexit.register
def _end_session() -> None:
    for pool in _POOLS.values():
        pool.stop()
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)


def _log() -> Path:
    log = _session_root() / "logs" / f"run{sum(RUN_COUNTS.values())}"
    log.parent.mkdir(exist_ok=True)
    return log


TRAIN_JOB = f"{__name__}:_train_job"


class RunTimedOut(BaseException):
    """An in-process run past its timeout: a BaseException, so no ``except Exception`` of the run swallows it."""


@contextmanager
def _deadline(seconds: float, what: str):
    """Interrupt an in-process run that outlives ``seconds`` (a SIGALRM raising in this, the main, thread: a loop
    that never ends fails the test instead of blocking the suite)."""
    def interrupt(signum, frame):
        raise RunTimedOut(f"{what} did not finish in {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def train(recipe: str, run_dir: Path, overrides: Sequence[str] = (), nproc: int = 1, timeout: float = 600,
          check: bool = True) -> subprocess.CompletedProcess:
    """A real training of ``recipe`` into ``run_dir`` on ``nproc`` ranks (the CPU, gloo), read like a launch: exit
    status, stdout and stderr (the ranks' outputs concatenated in rank order). One process runs here; several in
    the session's pool. ``check``: fail with the output unless it exited 0."""
    run_dir = Path(run_dir)
    command = [f"recipes.{recipe}.train", f"train.output_dir={run_dir}", *overrides]
    args = (recipe, str(run_dir), list(overrides))
    if nproc == 1:
        count_launch("in-process")
        with _deadline(timeout, " ".join(command)):
            ranks = [_call(TRAIN_JOB, args, _log())]
    else:
        count_launch("pooled")
        ranks = _pool(nproc).run(TRAIN_JOB, args, timeout, _log())
    status = max((r[0] for r in ranks), key=abs)
    result = subprocess.CompletedProcess(command, status, "".join(r[2] for r in ranks), "".join(r[3] for r in ranks))
    if check and status != 0:
        raise AssertionError(f"{' '.join(command)} ({nproc} ranks) exited {status}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def run_on_ranks(nproc: int, fn, *args, timeout: float = 600) -> list:
    """``fn(rank, *args)`` on each of ``nproc`` pooled ranks (``fn`` a module-level function; the ranks'
    environment is torchrun's, each call sets up its own process group): the return values in rank order. Where
    ``torch.multiprocessing.spawn`` would start ``nproc`` fresh interpreters per call. Fails with the ranks' output
    unless every rank returned."""
    count_launch("pooled")
    ranks = _pool(nproc).run(f"{fn.__module__}:{fn.__qualname__}", args, timeout, _log(), with_rank=True)
    if any(status != 0 for status, *_ in ranks):
        raise AssertionError(f"{fn.__qualname__} on {nproc} ranks failed:\n" + "\n".join(
            f"--- rank {rank} (status {status}) ---\n{out[-3000:]}\n{err[-6000:]}"
            for rank, (status, _, out, err) in enumerate(ranks)))
    return [value for _, value, _, _ in ranks]


def spawn_on_pool(fn, args: tuple = (), nprocs: int = 1, join: bool = True, **_) -> None:
    """A stand-in for ``torch.multiprocessing.spawn`` that a test sets (``monkeypatch``) where a tool starts its
    ranks that way and the fresh interpreters are not what the test checks: ``fn(rank, *args)`` runs on ``nprocs``
    of the session's pooled ranks (``run_on_ranks``: their own processes and process groups, forked ready) instead
    of ``nprocs`` interpreters importing torch and the engine again (~5-10 s each). Fails, as ``spawn`` raises, when
    a rank does."""
    if not join:
        raise NotImplementedError("spawn_on_pool runs the ranks to their end (join=True)")
    run_on_ranks(nprocs, fn, *args)


def _forked_rank(rank: int, nproc: int, environ: dict, port: int, args: tuple, log: str) -> None:
    """One rank of a ``ForkedRun``: the training job as a launched rank runs it, exiting with its status; the
    leader of a process group of its own, so a kill reaches what it starts (DataLoader workers) too."""
    os.setpgrp()
    os.environ.clear()
    os.environ.update(environ)
    if nproc > 1:  # torchrun's environment; a single launched process has none
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    multiprocessing.set_start_method("fork", force=True)
    raise SystemExit(_call(TRAIN_JOB, args, Path(f"{log}.rank{rank}"))[0])


class ForkedRun:
    """A training on ``nproc`` ranks, each a process of its own forked from the session's fork server, for a test
    to signal or kill mid-way (``start_forked``): a SIGTERM or SIGKILL lands on a training process as it would on a
    launched rank, without the ~10 s per process a fresh interpreter spends importing before its first step."""

    def __init__(self, recipe: str, run_dir: Path, overrides: Sequence[str], nproc: int):
        start_fork_server()
        context = mp.get_context("forkserver")
        self.log, port = _log(), _free_port()
        args = (recipe, str(run_dir), [*overrides])
        environ = {**os.environ, **LAUNCH_ENV}
        with _launch_env():
            self.ranks = [context.Process(target=_forked_rank, args=(rank, nproc, environ, port, args, str(self.log)))
                          for rank in range(nproc)]
            for process in self.ranks:
                process.start()

    def wait_until(self, predicate, timeout: float = 240) -> None:
        """Return once ``predicate()`` holds; fail with the ranks' stderr if the run ends first or ``timeout``
        passes (the run is killed)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if any(process.exitcode is not None for process in self.ranks):
                raise AssertionError(f"the run ended before the test could interrupt it:\n{self.stderr()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for the run:\n{self.stderr()[-4000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> list[int]:
        """Each rank's exit status once every rank has ended; fails (the run killed) after ``timeout``."""
        deadline = time.monotonic() + timeout
        for process in self.ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        if any(process.exitcode is None for process in self.ranks):
            self.kill()
            raise AssertionError(f"the run did not end in {timeout} s:\n{self.stderr()[-4000:]}")
        return [process.exitcode for process in self.ranks]

    def stderr(self) -> str:
        paths = (Path(f"{self.log}.rank{rank}.err") for rank in range(len(self.ranks)))
        return "".join(path.read_text() for path in paths if path.is_file())

    def kill(self) -> None:
        """SIGKILL every rank and every process under it at once."""
        for process in self.ranks:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.ranks:
            process.join(timeout=60)


def start_forked(recipe: str, run_dir: Path, overrides: Sequence[str] = (), nproc: int = 1) -> ForkedRun:
    """A training of ``recipe`` into ``run_dir`` on ``nproc`` ranks, running in the background for the test to
    signal (``ForkedRun.ranks``' pids) or kill (``ForkedRun.kill``); a test of a launcher's own behaviour starts a
    real launch (``launch.launch``)."""
    count_launch("forked")
    return ForkedRun(recipe, Path(run_dir), overrides, nproc)


_CACHE: dict[tuple, Path] = {}
_ROOT: list[Path] = []


def _session_root() -> Path:
    """One temporary folder per test session for what its tests share (reference runs, data sets)."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="vlm_packing_session_")))
    return _ROOT[0]


def cached_run(recipe: str, overrides: Sequence[str], nproc: int = 1) -> Path:
    """The run directory of a successful training of ``recipe`` with ``overrides`` on ``nproc`` ranks, trained on
    first use and shared by every test of the session asking for the same run (overrides compared as a set, so
    their order does not matter). Tests must only read it."""
    key = (recipe, nproc, tuple(sorted(overrides)))
    if key not in _CACHE:
        run_dir = _session_root() / f"run_{recipe}_{nproc}_{len(_CACHE)}"
        train(recipe, run_dir, overrides, nproc=nproc)
        _CACHE[key] = run_dir
    return _CACHE[key]


_DATA: dict[int, Path] = {}


def shared_mixed_jsonl(num_records: int = 11) -> Path:
    """One mixed image / text-only JSONL (``records.write_mixed_jsonl``) per size for the whole session: runs over
    it measure it once (the measure cache keys on the file) and reference runs over it can be shared."""
    from .records import write_mixed_jsonl

    if num_records not in _DATA:
        _DATA[num_records] = write_mixed_jsonl(_session_root() / f"mixed_{num_records}", num_records)
    return _DATA[num_records]


def session_demo_dir(num_samples: int, seed: int, videos: bool) -> Path:
    """The session's demo folder for these settings (the writer fills it on first use; later runs find it there
    and the measure cache, keyed on the file, hits)."""
    return _session_root() / f"demo_{num_samples}_{seed}_{'videos' if videos else 'images'}"
