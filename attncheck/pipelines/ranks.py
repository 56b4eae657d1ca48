"""``attncheck run`` split over the ranks of a torchrun job: which process is which, what each computes, and the
exchange that brings every rank's part to rank 0 and the one result back to every rank.

torch.distributed is the engine: the process group comes from torchrun's environment (``init_process_group`` with
its ``env://`` rendezvous), or is the one the caller's job has already initialised. The parts exchanged are pickled
results of our own processes (``gather_object``, ``broadcast_object_list``), a few kB per call, so the exchange
runs over gloo, on CPU and GPU machines alike (nccl would move the same bytes through the GPU for nothing, and
refuses two ranks on one GPU). Nothing here schedules: the share of each rank is decided up front, the same on
every rank, from the sizes the capture's headers give.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from attncheck.errors import AttncheckError

# A rank that finishes its share waits for the slowest in the gather: on a CPU a large capture takes hours, and a
# shorter wait would end the run there. A rank that dies ends the job through torchrun, not through this wait.
WAIT = timedelta(days=1)
ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets and env:// rendezvous reads


@dataclass(frozen=True)
class Job:
    """This process's place in the job: its rank, the world size, and its rank on this machine (its GPU)."""

    rank: int
    world: int
    local_rank: int


def split_job() -> Job | None:
    """The job whose ranks split a run: torch.distributed's group where it is initialised, else torchrun's environment
    (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, LOCAL_RANK); None for one process, a world of 1, or an environment
    without a rendezvous to join (such a process runs the whole run itself, as always)."""
    if not dist.is_available():
        return None
    env = os.environ
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif all(env.get(name) for name in ENV):
        rank, world = _integer("RANK", env["RANK"]), _integer("WORLD_SIZE", env["WORLD_SIZE"])
        if world > 1 and not 0 <= rank < world:
            raise AttncheckError(
                f"rank {rank} is not a rank of a world of {world} processes (RANK, WORLD_SIZE in the environment)"
            )
    else:
        return None
    if world <= 1:
        return None
    local = _integer("LOCAL_RANK", env["LOCAL_RANK"]) if env.get("LOCAL_RANK") else rank
    return Job(rank, world, local)


def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise AttncheckError(
            f"the environment's {name}={text[:40]!r} is not an integer (torchrun sets RANK, WORLD_SIZE and LOCAL_RANK "
            "to integers)"
        ) from None


def use_rank_gpu(job: Job, device: str) -> None:
    """Make 'cuda' (and 'auto' where CUDA is there) mean this rank's own GPU, LOCAL_RANK (modulo the GPUs there are:
    more ranks than GPUs share them): torch's current device, so that the device is still called 'cuda' and the
    report reads as a single process's. An explicit 'cuda:N' is left as given."""
    name = device.strip().lower()
    if name in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(job.local_rank % torch.cuda.device_count())


def assign(costs: list[int], world: int) -> list[int]:
    """The rank each unit goes to, the same on every rank: the largest unit first, each to the rank with the least
    work so far (the lowest rank on a tie). Units of a model's calls are alike or fall into a few sizes (a prefill and
    its decode steps), so the ranks end within one unit of each other."""
    owner = [0] * len(costs)
    load = [0] * world
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += max(1, costs[i])
    return owner


@dataclass
class Share:
    """One rank's share of a run, asked for by the run as it goes: the inputs (calls) it diagnoses, the layers whose
    KV-cache what-if it computes, and where it is (``at``), which orders failures as one process would meet them."""

    job: Job
    at: tuple[int, int] = (0, -1)  # (0: checks every rank makes alike; 1: call i; 2: the KV cache's call i)
    positions: list[int] = field(default_factory=list)  # the inputs this rank diagnoses, in call order
    kv_layers: list[str] = field(default_factory=list)  # every layer the KV cache replays, in the capture's order

    def calls(self, costs: list[int]) -> set[int]:
        """The positions of the inputs this rank diagnoses, of inputs costing ``costs`` (score elements)."""
        self.positions = [i for i, r in enumerate(assign(costs, self.job.world)) if r == self.job.rank]
        return set(self.positions)

    def kv_calls(self, calls: list) -> list:
        """This rank's KV-cache calls (``pipelines.kvcache.KVCall``): those of its layers. A layer's scales come from
        its own calls (the amax of all, or its first), so a layer stays on one rank and sees every one of its calls;
        each load says where the rank is."""
        modules = [c.module for c in calls]
        self.kv_layers = list(dict.fromkeys(modules))
        counts = [modules.count(m) for m in self.kv_layers]
        mine = {m for m, r in zip(self.kv_layers, assign(counts, self.job.world)) if r == self.job.rank}
        return [replace(c, load=self._loading(i, c.load)) for i, c in enumerate(calls) if c.module in mine]

    def _loading(self, i: int, load: Callable) -> Callable:
        def at_load():
            self.at = (2, i)
            return load()

        return at_load


def _join() -> bool:
    """Join the job's process group from torchrun's environment (gloo) where none is initialised; True if this made
    it (and so ends it)."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", timeout=WAIT)
    return True


@contextlib.contextmanager
def joined(job: Job | None) -> Iterator[None]:
    """The command's time in the job (nothing for one process): the process group held throughout, and at the end, once
    this rank's output is flushed, a barrier, so that no rank exits before rank 0 has written its report (torchrun
    stops the other ranks when one exits with a failing code, whichever finishes first)."""
    if job is None:
        yield
        return
    owned = _join()
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            dist.barrier()
        finally:
            if owned:
                dist.destroy_process_group()


@dataclass
class _Failure:
    at: tuple[int, int]
    rank: int
    error: AttncheckError | None  # bad input: every rank says it
    text: str = ""  # an unexpected exception: its type and message (its own rank raises it with its traceback)


def exchange(job: Job, work: Callable[[], Any], merge: Callable[[list], Any], where: Callable[[], tuple]) -> Any:
    """Run ``work`` on this rank, gather every rank's part on rank 0, ``merge`` them there (parts in rank order), and
    return the merged result on every rank. A failure on any rank reaches every rank, which raises the one a single
    process would have met first (by ``where()``, the position the work had reached): bad input as the same
    AttncheckError on every rank; an unexpected exception with its traceback on its own rank, and one line elsewhere.
    No rank is left waiting for another that has stopped."""
    owned = _join()
    try:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=WAIT)
        crash: BaseException | None = None
        try:
            mine: Any = ("ok", work())
        except AttncheckError as e:
            mine = ("failed", _Failure(where(), job.rank, e))
        except Exception as e:  # noqa: BLE001 - said to every rank, raised again below on this one
            crash, mine = e, ("failed", _Failure(where(), job.rank, None, f"{type(e).__name__}: {e}"))
        parts: list | None = [None] * job.world if job.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        box: list = [None]
        if job.rank == 0:
            failures = [p[1] for p in parts if p[0] == "failed"]
            if failures:
                box[0] = min(failures, key=lambda f: (f.at, f.rank))
            else:
                try:
                    box[0] = ("ok", merge([p[1] for p in parts]))
                except AttncheckError as e:
                    box[0] = _Failure((3, 0), 0, e)
                except Exception as e:  # noqa: BLE001 - as above
                    crash, box[0] = e, _Failure((3, 0), 0, None, f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        if owned:
            dist.destroy_process_group()
    outcome = box[0]
    if isinstance(outcome, tuple):
        return outcome[1]
    if outcome.error is not None:
        raise outcome.error
    if crash is not None and outcome.rank == job.rank:
        raise crash
    raise AttncheckError(f"rank {outcome.rank} of {job.world} stopped: {outcome.text} (its traceback is on its stderr)")


__all__ = ["Job", "Share", "assign", "exchange", "joined", "split_job", "use_rank_gpu"]
