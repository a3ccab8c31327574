"""All-reduce (sum) backends for tensor parallelism (real/model/tp.py): gloo, and same-host shared memory.

Both sum a tensor over the ranks of a process group in place. A backend is also callable from
native code: ``native()`` gives the address of a C function ``int fn(float* buf, long n, void*
ctx)`` and its ``ctx``, which ``specbed_kernels.native.decode_layers`` calls between the layers it fuses
(after each output and down projection); a non-zero return aborts that call and ``error(rc)``
says why.

- ``GlooAllReduce``: ``torch.distributed.all_reduce`` on the group (gloo for CPU tensors; NCCL
  for CUDA ones). Its native function is a ctypes callback into Python. Waits are bounded by the
  process group's timeout.
- ``ShmAllReduce``: the ranks of one host share a buffer in /dev/shm; each writes its partial sum
  to its slot and publishes a sequence number, then polls the peers' (specbed_kernels/shm_allreduce.cpp:
  flag + data, no barrier, double-buffered; after ``spin_us`` of polling a wait sleeps on a
  futex, which the late peer's publication wakes). Every wait has a timeout and names the peer that did
  not arrive. fp32 sums; other dtypes are summed in fp32 and rounded back.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import tempfile
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from specbed_kernels import native

SHM_SOURCE = Path(__file__).with_name("shm_allreduce.cpp")


class AllReduce(Protocol):
    """Sums tensors over the ranks of one tensor-parallel group."""

    rank: int
    world: int

    def __call__(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        ...

    def native(self) -> tuple[int, int] | None:
        """(address of ``int fn(float*, long, void*)``, ctx) for native kernels, or None."""
        ...

    def error(self, rc: int) -> Exception:
        """The exception for a non-zero return code of the native function."""
        ...


# --------------------------------------------------------------------------------- gloo
_NATIVE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p)


class GlooAllReduce:
    """``dist.all_reduce`` on ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._callback = _NATIVE_FN(self._from_native)  # kept alive as long as self
        self._failure: BaseException | None = None

    def __call__(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def _from_native(self, ptr: int, n: int, _ctx: int) -> int:
        try:  # an exception must not cross the C frames: report it through the return code
            buf = (ctypes.c_float * n).from_address(ptr)
            self(torch.frombuffer(buf, dtype=torch.float32))
            return 0
        except BaseException as exc:  # noqa: BLE001 - re-raised by error()
            self._failure = exc
            return 3

    def native(self) -> tuple[int, int]:
        return ctypes.cast(self._callback, ctypes.c_void_p).value, 0

    def error(self, rc: int) -> Exception:
        failure, self._failure = self._failure, None
        exc = RuntimeError(f"gloo all-reduce failed on rank {self.rank} inside the fused layers "
                           f"(code {rc}): {failure!r}")
        exc.__cause__ = failure
        return exc


# --------------------------------------------------------------------------------- shared memory
class _ShmContext(ctypes.Structure):  # shm_allreduce.cpp: Context
    _fields_ = [("base", ctypes.c_void_p), ("rank", ctypes.c_long), ("world", ctypes.c_long),
                ("capacity", ctypes.c_long), ("seq", ctypes.c_long), ("timeout_s", ctypes.c_double),
                ("spin_s", ctypes.c_double), ("failed_peer", ctypes.c_long)]


_SHM_LIB: ctypes.CDLL | None = None


def _shm_lib() -> ctypes.CDLL:
    global _SHM_LIB
    if _SHM_LIB is None:
        path = native.build(SHM_SOURCE)
        if path is None:
            raise RuntimeError("the shared-memory all-reduce needs a C++ compiler (g++) to build "
                               "specbed_kernels/shm_allreduce.cpp; use the gloo all-reduce instead")
        lib = ctypes.CDLL(str(path))
        lib.sb_ar_bytes.argtypes = [ctypes.c_long, ctypes.c_long]
        lib.sb_ar_bytes.restype = ctypes.c_long
        lib.sb_ar_allreduce.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
        lib.sb_ar_allreduce.restype = ctypes.c_int
        _SHM_LIB = lib
    return _SHM_LIB


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmAllReduce:
    """Shared-memory all-reduce among the ranks of ``group``, which must all be on this host.

    Collective to construct (every rank of the group, together): rank 0 creates the buffer file,
    its name goes to the others over the group, every rank maps it, and rank 0 removes the file
    once all have (the mapping outlives it, so nothing is left in /dev/shm even after a crash).
    ``capacity``: floats per slot (larger inputs go in chunks); ``timeout_s``: the longest wait
    for a peer before ``TimeoutError`` naming it; ``spin_us``: how long a wait polls before it
    sleeps on a futex (polling is fastest when every rank has its own core; sleeping lets an
    oversubscribed machine run the peer that is late).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, capacity: int = 1 << 16,
                 timeout_s: float = 30.0, spin_us: float = 100.0) -> None:
        lib = _shm_lib()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = timeout_s
        size = lib.sb_ar_bytes(self.world, capacity)
        name = [None]
        if self.rank == 0:
            fd, name[0] = tempfile.mkstemp(prefix="specbed-allreduce-", dir=_shm_dir())
            os.ftruncate(fd, size)  # zero-filled: every sequence number starts at 0
            os.close(fd)
        try:
            dist.broadcast_object_list(name, group=group, group_src=0)
            with open(name[0], "r+b") as f:
                self._map = mmap.mmap(f.fileno(), size)
            dist.barrier(group=group)  # everyone mapped it: the file itself can go
        finally:
            if self.rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name[0])
        self.path = name[0]  # removed already; kept to say which buffer this was
        self._base = ctypes.c_char.from_buffer(self._map)  # pins the mapping while referenced
        self._ctx = _ShmContext(ctypes.addressof(self._base), self.rank, self.world, capacity, 0,
                                timeout_s, spin_us * 1e-6, -1)
        self._fn = ctypes.cast(lib.sb_ar_allreduce, ctypes.c_void_p).value
        self._allreduce = lib.sb_ar_allreduce

    def __call__(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            raise ValueError(f"ShmAllReduce sums CPU tensors only (got one on {x.device})")
        buf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        rc = self._allreduce(buf.data_ptr(), buf.numel(), ctypes.byref(self._ctx))
        if rc:
            raise self.error(rc)
        if buf is not x:
            x.copy_(buf)
        return x

    def native(self) -> tuple[int, int]:
        return self._fn, ctypes.addressof(self._ctx)

    def error(self, rc: int) -> Exception:
        if rc == 2:
            return TimeoutError(f"shared-memory all-reduce: rank {self.rank} waited {self.timeout_s:g} s "
                                f"for rank {self._ctx.failed_peer} (all-reduce #{self._ctx.seq}); that "
                                "rank died, hangs or stopped calling the all-reduce")
        return RuntimeError(f"shared-memory all-reduce failed on rank {self.rank} (code {rc})")

    def close(self) -> None:
        """Unmap the buffer (no call may follow)."""
        del self._base
        self._map.close()


def make(kind: str, group: dist.ProcessGroup | None = None, **kwargs) -> AllReduce:
    """``kind``: "gloo" (``dist.all_reduce``) or "shm" (same host); kwargs go to ShmAllReduce."""
    if kind == "gloo":
        return GlooAllReduce(group)
    if kind == "shm":
        return ShmAllReduce(group, **kwargs)
    raise ValueError(f"unknown all-reduce {kind!r}: use 'gloo' or 'shm'")
