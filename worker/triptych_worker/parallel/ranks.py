"""A multi-device role: rank 0 is the worker the head sees; ranks 1..N-1 are follower processes.

    pipeline = start_ranks(args, catalog)  # rank 0, inside `triptych serve --num-gpus N`
    pipeline.run(batch)                    # every rank runs the job; rank 0 returns its outputs
    pipeline.run_many(batches)             # compatible requests as one batched forward, on every rank

Rank 0 starts one follower process per other device (`python -m triptych_worker.parallel.follower`
with the same flags), all ranks load the role's stages and rendezvous on `--master-port`, and
each job rank 0 runs is broadcast to the followers first. The worker keeps one work socket, one
set of slots and one Mooncake pool: the followers talk to rank 0 only. A denoiser's job stops at a
step boundary on every rank when the head hands it off (handoff.py); rank 0 stages the state.
A group of compatible requests (--batching-max-size) is one job: every rank runs it as one batched
forward, each request with its own step flags, so one cancelled or handed off stops on every rank
at the same step while the others run on (triptych_worker.batching).

A request's LoRA adapters load on every rank, from the sources rank 0's catalogue gave as it sent the
job; a load that fails on any rank fails the request on every rank before it denoises (lora.py), one
of the failures (with a cancel and a state that cannot be restored) after which the ranks are still
in step. Rank 0 alone resolves adapter names, so it alone re-reads the --lora-catalog file: its
catalogue is the one the worker checked at start-up (runtime.py), and a re-read entry without
adapter weights is logged there, once (triptych.lora). A follower holds an empty catalogue (a job
pins rank 0's sources) and never reads the file, so it logs nothing about it, not even a file it
cannot parse: every rank writes to the pod's one log, where a warning per rank would repeat it N
times; a follower logs a load of its own that fails.

A rank that dies takes the instance down: rank 0 watches its followers and exits (status 3)
when one exits, or when rank 0 itself fails inside a job (the ranks are then out of step), so
the head stops hearing its heartbeats and retries what it held elsewhere; followers die with
rank 0 (the kernel's parent-death signal) or on a broken collective.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triptych.config import ServeArgs
from triptych.lora import BadAdapter, LoraCatalog
from triptych.parallelism import Parallelism
from triptych.ports import DEFAULT_MASTER_PORT_OFFSET
from triptych_worker.adapters import adapter_for
from triptych_worker.parallel import families
from triptych_worker.parallel.apply import WorkCounter, parallelize, parameter_bytes
from triptych_worker.parallel.handoff import states_agree
from triptych_worker.parallel.jobs import GO_ON, STOP, StepBoundary, StopFollowing, receive_jobs, send_jobs, step_flag
from triptych_worker.parallel.layout import RankLayout
from triptych_worker.parallel.mesh import RankMesh
from triptych_worker.parallel.tp_load import load_transformer_cut
from triptych_worker.resume import RESUME, CannotResume
from triptych_worker.stages import ProgressCallback, StageBatch

if TYPE_CHECKING:
    from triptych.params import GenerationParams
    from triptych_worker.lora import LoraAdapters
    from triptych_worker.pipeline import RolePipeline
    from triptych_worker.preview import LatentPreviewer
    from triptych_worker.step_cache import StepCaching

log = logging.getLogger(__name__)

RANK_DIED_EXIT = 3
WATCH_INTERVAL_S = 0.2
IN_STEP_FAILURES = (CannotResume, BadAdapter)
"""What every rank raises together, at the same point of a job (a state that cannot be captured or
restored; adapters that did not load on every rank): the ranks are still in step after it."""


def master_port(args: ServeArgs) -> int:
    """Where the ranks meet: --master-port, else the work port + DEFAULT_MASTER_PORT_OFFSET (triptych.ports)."""
    return args.master_port if args.master_port is not None else args.scheduler_port + DEFAULT_MASTER_PORT_OFFSET


def rank_device(args: ServeArgs, rank: int) -> str:
    """One device per rank: cuda:<base-gpu-id + rank>, or the CPU for every rank."""
    device = args.resolved_device
    return f"cuda:{args.base_gpu_id + rank}" if device.startswith("cuda") else device


@dataclass
class Rank:
    """One rank's loaded stages, its place in the mesh and its work counter."""

    pipeline: RolePipeline
    mesh: RankMesh
    work: WorkCounter
    family: str

    @classmethod
    def start(cls, args: ServeArgs, rank: int, lora_catalog: LoraCatalog) -> Rank:
        """Check the degrees against the family, load the stages, join the other ranks, split the model.
        `lora_catalog`: rank 0's, the one the worker checked; a follower's, empty (module docstring)."""
        from triptych_worker.cpu_threads import fit_torch_threads
        from triptych_worker.pipeline import BatchedAdapterStage, load_role_pipeline

        fit_torch_threads(processes=args.num_gpus)  # the pod's CPU limit, shared by its rank processes
        family, adapter = adapter_for(args.model_path)
        degrees = families.check_degrees(args, family, adapter)
        device = rank_device(args, rank)
        # A TP rank reads only its cut of the transformer, straight onto its device (tp_load.py).
        dtype = args.compute_dtype(device)
        given: dict[str, Any] = {}
        if degrees.tp > 1:
            tp_index = RankLayout(degrees).tp_index(rank)
            given["transformer"] = load_transformer_cut(adapter.package, family, degrees.tp, tp_index, device, dtype)
        pipeline = load_role_pipeline(
            args.model_path,
            args.disagg_role,
            device,
            lora_catalog=lora_catalog,
            lora_cache_bytes=args.lora_cache_bytes,
            given=given,
            dtype=dtype,
        )
        for stage in pipeline.stages:  # a failed batched forward is not run again alone on one rank
            if isinstance(stage, BatchedAdapterStage):
                stage.retry_alone = False
        mesh = RankMesh.join(rank, degrees, device, master_port(args))
        return cls(pipeline, mesh, parallelize(pipeline, mesh), family)

    @property
    def degrees(self) -> Parallelism:
        return self.mesh.degrees

    def run(self, batch: StageBatch, lora_sources: dict[str, str]) -> StageBatch:
        self.mesh.comm.reset()
        with self._pinned(lora_sources):
            return self.pipeline.run(batch)

    def run_many(self, batches: list[StageBatch], lora_sources: dict[str, str]) -> list[Exception | None]:
        self.mesh.comm.reset()
        with self._pinned(lora_sources):
            return self.pipeline.run_many(batches)

    def lora_sources(self, batches: list[StageBatch]) -> dict[str, str]:
        """Rank 0: the sources its catalogue gives now for the adapters these requests use."""
        loras = self.pipeline.loras
        return {} if loras is None else {k: v for batch in batches for k, v in loras.sources(batch.params).items()}

    @contextmanager
    def _pinned(self, lora_sources: dict[str, str]) -> Iterator[None]:
        loras = self.pipeline.loras
        if loras is None:
            yield
            return
        with loras.pinned(lora_sources):
            yield

    def stopped_states_agree(self, batch: StageBatch) -> list[str]:
        """After a job (every rank): if its loop stopped at a step boundary, the state tensors the
        ranks hold different bytes of (handoff.states_agree); empty otherwise."""
        return states_agree(self.mesh, batch) if RESUME in batch.meta else []

    def gather_counters(self) -> list[tuple[int, float, int]]:
        """(work, seconds in collectives, parameter bytes held) of every rank, gathered at rank 0 after a job."""
        import torch

        held = float(parameter_bytes(self.pipeline))
        mine = torch.tensor([float(self.work.work), self.mesh.comm.seconds, held], dtype=torch.float64)
        gathered = self.mesh.all_gather_cat(mine.to(self.mesh.device), None, dim=0).view(-1, 3).cpu()
        return [(int(work), float(seconds), int(held)) for work, seconds, held in gathered.tolist()]


class ParallelPipeline:
    """Rank 0's pipeline: what the worker runs, with its followers running each job alongside."""

    def __init__(self, rank: Rank, followers: list[subprocess.Popen[bytes]]):
        self.rank = rank
        self.followers = followers
        self.last_counters: list[tuple[int, float, int]] = []
        self.last_fanout_s = 0.0  # what handing the job's inputs to the followers added to this hop

    def run(self, batch: StageBatch) -> StageBatch:
        self.check(batch)
        sources = self.rank.lora_sources([batch])
        (steps,) = self._lead([batch], sources)
        started = time.perf_counter()
        try:
            self.rank.run(batch, sources)
        except IN_STEP_FAILURES:  # every rank failed at the same point
            self.rank.gather_counters()
            raise
        except BaseException:
            if not steps.stopped:  # the followers are somewhere inside the job: no way back into step
                log.critical("rank 0 failed inside a job; the ranks are out of step, stopping this instance")
                _exit_instance()
            self.rank.gather_counters()  # the followers stopped at the same step and gather next
            raise
        (error,) = self._finish([batch], started)
        if error is not None:
            raise error
        return batch

    def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
        """Compatible requests (triptych.batching) as one job: every rank runs them as one batched
        forward. Per request, the exception it failed with or None. A failure that may have left the
        ranks out of step (anything but a cancel or a state that cannot be restored) stops the instance."""
        outcomes = self.refusals(batches)  # refused before any rank sees them
        group = [i for i, error in enumerate(outcomes) if error is None]
        if not group:
            return outcomes
        members = [batches[i] for i in group]
        for member in members:  # a member that stops early is staged after the ranks agree on its state
            member.leave = None  # (_finish, every rank at once), with the group's others
        sources = self.rank.lora_sources(members)
        try:
            steps = self._lead(members, sources)
        except ValueError as exc:  # refused before any rank saw the job (send_jobs): the group fails, in step
            return [exc if error is None else error for error in outcomes]
        started = time.perf_counter()
        try:
            ran = self.rank.run_many(members, sources)
        except BaseException:
            log.critical("rank 0 failed inside a batched job; the ranks are out of step, stopping this instance")
            _exit_instance()
            raise
        for error, leading in zip(ran, steps, strict=True):
            if error is not None and not isinstance(error, IN_STEP_FAILURES) and not leading.stopped:
                log.critical("rank 0 failed a request of a batched job (%s); the ranks may be out of step, "
                             "stopping this instance", error)  # fmt: skip
                _exit_instance()
        for i, error, differ in zip(group, ran, self._finish(members, started), strict=True):
            outcomes[i] = error or differ
        return outcomes

    def validate(self, params: GenerationParams) -> None:
        """Raise ValueError naming the field when the model cannot serve `params` (rank 0's stages check
        it as one device's do; what only the ranks' split refuses is `check`'s)."""
        self.rank.pipeline.validate(params)

    def check(self, batch: StageBatch) -> None:
        """Raise ValueError naming the field when these ranks cannot run the request (parallel/families.py)."""
        adapter = self.rank.pipeline.adapter
        families.check_request(adapter, self.rank.family, batch.params, self.rank.degrees, self.rank.pipeline.role)

    def refusals(self, batches: list[StageBatch]) -> list[Exception | None]:
        """Per request, the error `check` refuses it with, or None."""
        refused: list[Exception | None] = []
        for batch in batches:
            try:
                self.check(batch)
            except Exception as exc:  # a check that fails in another way refuses the request too
                refused.append(exc)
            else:
                refused.append(None)
        return refused

    def _lead(self, batches: list[StageBatch], lora_sources: dict[str, str]) -> list[LeadingSteps]:
        """Send the job to the followers, then lead each request's steps: its progress (and its
        hand-off answers) go to the followers in its step flags."""
        started = time.perf_counter()
        send_jobs(self.rank.mesh, batches, lora_sources)
        self.last_fanout_s = time.perf_counter() - started
        steps = []
        for batch in batches:
            boundary = None
            if batch.hand_off is not None:  # after send_jobs: the followers ask before each step too
                batch.hand_off = boundary = StepBoundary(self.rank.mesh, batch.hand_off)
            leading = LeadingSteps(self.rank.mesh, batch.on_progress, boundary)
            batch.on_progress = leading
            steps.append(leading)
        return steps

    def _finish(self, batches: list[StageBatch], started: float) -> list[CannotResume | None]:
        """After a job that ran to its end on every rank: per request, CannotResume when its loop
        stopped with state the ranks hold different bytes of (staging rank 0's copy would continue
        from a part of the state, into other pixels); then the ranks' counters."""
        elapsed = time.perf_counter() - started
        differs = [self.rank.stopped_states_agree(batch) for batch in batches]
        self.last_counters = self.rank.gather_counters()
        log.info(
            "parallel job (%s, %d requests): inputs to the followers in %.4fs, ran in %.3fs; %s work per rank %s; "
            "seconds in collectives per rank %s; parameter bytes per rank %s",
            _describe(self.rank.degrees), len(batches), self.last_fanout_s, elapsed, self.rank.work.kind,
            [w for w, _, _ in self.last_counters], [round(s, 4) for _, s, _ in self.last_counters],
            [b for _, _, b in self.last_counters],
        )  # fmt: skip
        what = _describe(self.rank.degrees)
        return [
            CannotResume(f"the ranks hold different {', '.join(differ)} at the step boundary; "
                         f"this parallelism ({what}) cannot hand a request off") if differ else None
            for differ in differs
        ]  # fmt: skip

    @property
    def hands_off(self) -> bool:
        """Whether the role's denoising can stop at a step boundary and continue elsewhere: as one rank's."""
        return self.rank.pipeline.hands_off

    def previewer(self) -> LatentPreviewer | None:
        """Previews as one rank's: rank 0 holds the whole latents after each step (the shards are
        joined, the branches gathered, inside the step)."""
        return self.rank.pipeline.previewer()

    @property
    def loras(self) -> LoraAdapters | None:
        """Rank 0's adapters (every rank holds the same ones): what the heartbeats report."""
        return self.rank.pipeline.loras

    @property
    def step_cache(self) -> StepCaching | None:
        """Rank 0's step-cache counts: what the heartbeats report."""
        return self.rank.pipeline.step_cache


class LeadingSteps:
    """Rank 0's progress callback: the worker's own (which raises to cancel), then the step flag to
    the followers, with the answer to the next step's hand-off question when the job may hand off."""

    def __init__(self, mesh: RankMesh, report: ProgressCallback | None, boundary: StepBoundary | None = None):
        self.mesh = mesh
        self.report = report
        self.boundary = boundary
        self.stopped = False

    def __call__(self, step: int, total: int, latents: Any = None) -> None:
        try:
            if self.report is not None:
                self.report(step, total, latents)
        except BaseException:
            self.stopped = True
            step_flag(self.mesh, STOP)
            raise
        _carry(self.boundary, step_flag(self.mesh, self.boundary.decide() if self.boundary else GO_ON))


def _carry(boundary: StepBoundary | None, flag: int) -> None:
    if boundary is not None:
        boundary.carry(flag)


def _follow_step(mesh: RankMesh, boundary: StepBoundary | None, step: int, total: int, latents: Any = None) -> None:
    """A follower's progress callback: rank 0's step flag (stop now, or the next hand-off answer)."""
    flag = step_flag(mesh)
    if flag == STOP:
        raise StopFollowing
    _carry(boundary, flag)


def _exit_instance() -> None:
    logging.shutdown()
    os._exit(RANK_DIED_EXIT)


def _describe(d: Parallelism) -> str:
    return f"cfg {d.cfg} x ulysses {d.ulysses} x ring {d.ring} x tp {d.tp}"


def start_ranks(args: ServeArgs, lora_catalog: LoraCatalog) -> ParallelPipeline:
    """Rank 0: start the followers, join them, and watch them for as long as this process lives.
    `lora_catalog`: the worker's, checked at its start (module docstring)."""
    # Refuse what the family cannot run before any process starts.
    family, adapter = adapter_for(args.model_path)
    world = RankLayout(families.check_degrees(args, family, adapter)).world_size
    argv = [sys.executable, "-m", "triptych_worker.parallel.follower"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    followers = [subprocess.Popen([*argv, str(rank), *args.to_argv()], env=env) for rank in range(1, world)]
    watchdog = threading.Thread(target=_watch, args=(followers,), name="rank-watchdog", daemon=True)
    watchdog.start()
    rank = Rank.start(args, 0, lora_catalog)
    log.info("%d ranks joined on port %d (%s)", world, master_port(args), _describe(rank.degrees))
    return ParallelPipeline(rank, followers)


def _watch(followers: list[subprocess.Popen[bytes]]) -> None:
    """Exit this worker as soon as a follower exits: a role is all its ranks or none."""
    while True:
        for i, follower in enumerate(followers, start=1):
            code = follower.poll()
            if code is not None:
                log.error("rank %d exited with status %s; stopping this instance (the head will see it gone)", i, code)
                for other in followers:
                    if other.poll() is None:
                        other.kill()
                _exit_instance()
        time.sleep(WATCH_INTERVAL_S)


def die_with_parent() -> None:
    """A follower gets SIGKILL when rank 0 dies, however it dies (Linux; elsewhere a broken collective ends it)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def check_in_step(errors: list[Exception | None]) -> None:
    """A follower's outcomes of a batched job, each request's its own (as on rank 0): one that failed
    here other than by rank 0's stop or at the same point on every rank (IN_STEP_FAILURES) may have
    left this rank out of step with rank 0, which would then wait in a collective this rank never
    joins. It is raised: the follower ends, and rank 0's watchdog ends the instance at once, as rank 0
    does after such a failure of its own."""
    for error in errors:
        if error is not None and not isinstance(error, (StopFollowing, *IN_STEP_FAILURES)):
            raise error


def follow(args: ServeArgs, rank_index: int) -> None:
    """A follower: run every job rank 0 broadcasts until the process is killed or a collective breaks."""
    rank = Rank.start(args, rank_index, LoraCatalog())  # it resolves no name: each job pins rank 0's sources
    mesh = rank.mesh

    while True:
        batches, lora_sources = receive_jobs(mesh)
        for batch in batches:
            boundary = batch.hand_off if isinstance(batch.hand_off, StepBoundary) else None
            batch.on_progress = functools.partial(_follow_step, mesh, boundary)
        if len(batches) > 1:
            check_in_step(rank.run_many(batches, lora_sources))
        else:
            try:
                rank.run(batches[0], lora_sources)
            except (StopFollowing, *IN_STEP_FAILURES):  # cancelled, or failed on every rank at one point
                rank.gather_counters()  # as rank 0 does after a job that did not run to its end
                continue
        for batch in batches:
            rank.stopped_states_agree(batch)  # rank 0 fails a request whose states differ
        rank.gather_counters()
