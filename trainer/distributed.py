"""Beyond one machine: one pipeline process per node, drafter gradients all-reduced with torch.distributed.

Under ``torchrun`` (``WORLD_SIZE`` > 1) each process runs the threaded pipeline of its node
(:mod:`trainer.pipeline`); after the in-process reduction of its drafter replicas' gradients, the
flat gradient buffer is summed across processes (NCCL on GPUs, gloo on CPUs) and every replica of
every process applies the same mean. Ring all-reduce gives every rank the same bits, so replicas stay
identical across processes as well as within one.

Every process reads the same data in the same order and takes its own micro-batches of each step
(:func:`trainer.pipeline.micro_index`); only rank 0 writes checkpoints, ``metrics.jsonl`` and the
drafter folder, so ``--out-dir`` must be visible to every node for ``--resume``.
"""

import datetime
import hashlib
import os

import torch
import torch.distributed as tdist

__all__ = ["Dist", "init_distributed", "world_from_env"]


def world_from_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_world_size)`` as torchrun sets them (``0, 1, 1`` outside torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return rank, world, local_world


class Dist:
    """The process group as the pipeline uses it; a single process is a group of one (no-ops)."""

    def __init__(self, rank: int = 0, world: int = 1, backend: str = None, device=None):
        self.rank, self.world, self.backend = rank, world, backend
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.enabled:
            tdist.broadcast(t, src)
        return t

    def check_same(self, what: str, text: str) -> None:
        """Raise if ``text`` (e.g. the config) differs between processes (compared by a 62-bit hash)."""
        if not self.enabled:
            return
        h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2
        t = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        if int(t[0]) != h or int(t[1]) != -h:
            raise ValueError(f"{what}: differs between the {self.world} processes (rank {self.rank} has "
                             f"hash {h:x}); launch every process with the same arguments")

    def close(self) -> None:
        if self.enabled and tdist.is_initialized():
            tdist.destroy_process_group()


def init_distributed(device: torch.device, timeout_s: float, log=print, per_rank_devices: bool = False) -> Dist:
    """Join the torchrun process group if there is one; ``device`` is where the reduced buffer lives.

    NCCL for a CUDA ``device``, gloo for the CPU. One process per node: the GPU lists name the node's
    own GPUs, so several processes on one node would share them, unless the lists were given per
    process (``per_rank_devices``: ``--target-gpus "0-2;4-6"``).
    """
    rank, world, local_world = world_from_env()
    if world <= 1:
        return Dist(device=device)
    device = torch.device(device)
    if device.type == "cuda" and local_world > 1 and not per_rank_devices:
        raise ValueError(f"torchrun: {local_world} processes on this node share its GPU lists; run one process per "
                         f"node (--nproc-per-node 1), or give one list per process: --target-gpus '0-2;4-6'")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device
    log(f"distributed: joining as rank {rank} of {world} ({backend}, master "
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')})")
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    d = Dist(rank, world, backend, device)
    probe = torch.ones(1, device=device)
    d.all_reduce_sum_(probe)
    if int(probe.item()) != world:
        raise RuntimeError(f"distributed: a test all-reduce gave {probe.item()}, expected {world}")
    log(f"distributed: rank {rank} of {world} ready")
    return d
