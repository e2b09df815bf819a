"""Reused shared-memory buffers for the batches DataLoader workers send to the main process.

torch passes a tensor from a worker by putting it in a fresh shared-memory segment: its pages are zero-filled
on first touch and its handle travels through a socket, worker and main-process time paid per batch that
filling memory already mapped does not pay (docs/benchmarks.md). Here the main process maps, once,
a ring of ``slots`` buffers per worker, each as large as a batch the budget allows (untouched pages cost no
memory); a worker decodes a batch straight into a free buffer of its row and sends only where its tensors
lie, and the main process turns that back into tensors viewing the buffer (`_placed()`): no copy, no new
segment.

When a batch is released, the main process also drops its buffer's pages from its own mapping
(``madvise(MADV_DONTNEED)``; the data stays in shared memory for the worker that reuses it): the main process then
maps only the batches the loop holds, as with fresh segments, instead of every buffer it ever read. Resident-set
figures (``top``, and job accounting that sums the RSS of a job's processes) would otherwise count the whole
ring twice, once in the main process and once in the workers.

The contract, which never depends on what the training loop does: a buffer is written again only once nothing
in the main process refers to its batch any more. All of a batch's tensors share one NumPy base; its finalizer
marks the buffer free. A loop may keep a batch, or any view of it, as long as it likes (logging, a replay
queue): that only holds the buffer, and while a worker finds none of its buffers free, or a batch does not
fit, the batch goes the ordinary way (a fresh segment).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import math
import mmap
import os
import sys
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: every tensor of a batch starts on a cache line, so any dtype can view it
SMALL = 1 << 16  # room per buffer for the small tensors of a batch (lengths, cu_seqlens) beside the payload
SHM_SHARE = 0.5  # the rings of one loader take at most this share of the free shared memory (/dev/shm)
_RINGS: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()  # main process, by token
_BASES: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()  # a batch's base array
_CURRENT: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("streambatch_batch_slot", default=None)


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where its MADV_DONTNEED keeps shared data (Linux); None elsewhere."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def _free_shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class BatchRing:
    """``num_workers`` rows of ``slots`` buffers of ``slot_bytes`` each, in one shared segment made by the main
    process, and one shared flag per buffer (0 free, 1 written by its worker and not yet released)."""

    def __init__(self, num_workers: int, slots: int, slot_bytes: int):
        self.token = uuid.uuid4().hex
        # whole pages per buffer, so each one's pages can be dropped from the main process alone
        self.num_workers, self.slots, self.slot_bytes = num_workers, slots, _aligned(slot_bytes, mmap.PAGESIZE)
        storage = torch.UntypedStorage._new_shared(num_workers * slots * self.slot_bytes)
        self.data = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.flags = torch.zeros((num_workers, slots), dtype=torch.int8).share_memory_()
        self.held: set[tuple[int, int]] = set()  # main process: buffers some batch still refers to
        _RINGS[self.token] = self

    @classmethod
    def for_budget(cls, num_workers: int, budget: float, bytes_per_element: int, slots: int) -> BatchRing | None:
        """A ring whose buffers hold a padded batch of ``budget`` elements (payload and mask: ``bytes_per_element``
        each); fewer buffers where shared memory is short, None where not even two per worker fit."""
        slot_bytes = _aligned(int(budget * 1.05) * bytes_per_element) + SMALL
        free = _free_shm_bytes()
        if free is not None:
            slots = min(slots, int(free * SHM_SHARE) // (slot_bytes * num_workers))
        if slots < 2:
            log.info("shared memory too small for reused batch buffers (%s bytes free): fresh segment per batch", free)
            return None
        return cls(num_workers, slots, slot_bytes)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "held"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, held=set())

    def span(self, worker: int, k: int) -> int:
        """Where buffer ``k`` of ``worker`` starts in the segment."""
        return (worker * self.slots + k) * self.slot_bytes

    def drop_pages(self, worker: int, k: int) -> None:
        """Unmap buffer ``k`` of ``worker`` from this process's resident set; its data stays in shared memory
        (a later read maps it again)."""
        if _MADVISE is not None:
            _MADVISE(self.data.data_ptr() + self.span(worker, k), self.slot_bytes, mmap.MADV_DONTNEED)

    def writer(self, worker: int) -> RingWriter:
        return RingWriter(self, worker)

    def reclaim(self) -> int:
        """Free the buffers marked written that no batch in this process refers to: those a pass's workers filled
        but that never arrived (the pass stopped early). Only when no worker of this ring is running."""
        flags = self.flags.numpy()
        lost = [(w, k) for w, k in zip(*np.nonzero(flags)) if (int(w), int(k)) not in self.held]
        for w, k in lost:
            flags[w, k] = 0
        return len(lost)


class Slot:
    """One claimed buffer, in the worker that fills it: tensors are cut from it in turn."""

    def __init__(self, ring: BatchRing, worker: int, k: int, seq: int):
        self.ring, self.worker, self.k, self.seq = ring, worker, k, seq
        self.start, self.used = ring.span(worker, k), 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor in this buffer, or None where it does not fit."""
        nbytes = math.prod(shape) * dtype.itemsize
        off = _aligned(self.used)
        if off + nbytes > self.ring.slot_bytes:
            return None
        self.used = off + nbytes
        lo = self.start + off
        return self.ring.data[lo : lo + nbytes].view(dtype).view(shape)

    def _place(self, t: torch.Tensor) -> Placed | torch.Tensor:
        """Where tensor ``t`` lies in this buffer (copied in first when it fits), or ``t`` as it is."""
        ptr, lo = t.data_ptr(), self.ring.data.data_ptr() + self.start
        inside = t.untyped_storage().data_ptr() == self.ring.data.data_ptr() and lo <= ptr < lo + self.ring.slot_bytes
        if not inside:
            if t.device.type != "cpu" or t.requires_grad:
                return t
            dst = self.tensor(tuple(t.shape), t.dtype)
            if dst is None:
                return t
            dst.copy_(t)
            t, ptr = dst, dst.data_ptr()
        if not t.is_contiguous():
            return t
        return Placed(self.ring.token, self.worker, self.k, (os.getpid(), self.seq), ptr - lo, tuple(t.shape), t.dtype)

    def export(self, batch: Any) -> Any:
        """The batch (a dict, or a list of micro-batch dicts) with its tensors as `Placed`; the buffer is
        released at once when none of them lies in it."""
        placed = False

        def put(d: dict[str, Any]) -> dict[str, Any]:
            nonlocal placed
            out = {}
            for key, v in d.items():
                if isinstance(v, torch.Tensor):
                    v = self._place(v)
                    placed = placed or isinstance(v, Placed)
                out[key] = v
            return out

        out = [put(d) for d in batch] if isinstance(batch, list) else put(batch) if isinstance(batch, dict) else batch
        if not placed:
            self.release()
        return out

    def release(self) -> None:
        self.ring.flags.numpy()[self.worker, self.k] = 0


class Placed:
    """A tensor of a batch as a place in a ring buffer; unpickled in the main process, it is that tensor."""

    __slots__ = ("token", "worker", "k", "seq", "offset", "shape", "dtype")

    def __init__(
        self,
        token: str,
        worker: int,
        k: int,
        seq: tuple[int, int],
        offset: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ):
        self.token, self.worker, self.k, self.seq = token, worker, k, seq
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], tuple]:
        return _placed, (self.token, self.worker, self.k, self.seq, self.offset, self.shape, str(self.dtype))


def _release(ring: BatchRing, flags: np.ndarray, worker: int, k: int) -> None:
    ring.held.discard((worker, k))
    ring.drop_pages(worker, k)
    flags[worker, k] = 0


def _placed(
    token: str, worker: int, k: int, seq: tuple[int, int], offset: int, shape: tuple[int, ...], dtype: str
) -> torch.Tensor:
    """The tensor a `Placed` names, viewing its buffer: all tensors of one batch share one base array,
    whose finalizer (run once nothing refers to any of them) hands the buffer back to its worker."""
    ring = _RINGS.get(token)
    if ring is None:
        raise RuntimeError("a batch arrived from a StreamBatchLoader that no longer exists")
    key = (token, worker, k, seq)
    base = _BASES.get(key)
    if base is None:
        lo = ring.span(worker, k)
        base = ring.data.numpy()[lo : lo + ring.slot_bytes]  # a new array object: this batch's base
        ring.held.add((worker, k))
        weakref.finalize(base, _release, ring, ring.flags.numpy(), worker, k)
        _BASES[key] = base
    dt = getattr(torch, dtype.split(".")[-1])
    nbytes = math.prod(shape) * dt.itemsize
    return torch.from_numpy(base)[offset : offset + nbytes].view(dt).view(shape)


class RingWriter:
    """A worker's end of the ring: claims its free buffers in turn and makes each batch in one."""

    def __init__(self, ring: BatchRing, worker: int):
        self.ring, self.worker = ring, worker
        self.flags = ring.flags.numpy()
        self.next, self.seq = 0, 0

    def claim(self) -> Slot | None:
        """The next free buffer of this worker, marked written; None when the main process holds them all."""
        row = self.flags[self.worker]
        for j in range(self.ring.slots):
            k = (self.next + j) % self.ring.slots
            if row[k] == 0:
                row[k] = 1
                self.next, self.seq = k + 1, self.seq + 1
                return Slot(self.ring, self.worker, k, self.seq)
        return None

    def __call__(self, make: Callable[[], Any]) -> Any:
        """``make()`` (decode and pad one batch) with a free buffer as the batch's memory, placed for sending."""
        slot = self.claim()
        if slot is None:
            return make()
        with _in_slot(slot):
            try:
                out = make()
            except BaseException:
                slot.release()
                raise
        return slot.export(out)


@contextlib.contextmanager
def _in_slot(slot: Slot) -> Iterator[None]:
    token = _CURRENT.set(slot)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def slot_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised tensor in the buffer of the batch being made, or None (no ring, or it is full)."""
    slot = _CURRENT.get()
    return None if slot is None else slot.tensor(shape, dtype)


def batch_ring(num_workers: int, budget: float | None, decode: Any, prefetch_factor: int | None) -> BatchRing | None:
    """The ring a loader's workers make their batches in: buffers for a padded batch of ``budget`` elements
    (float32 audio or int64 tokens, and the bool mask), as many per worker as batches it can have in flight
    (``prefetch_factor``), one being made and one held by the training loop; None at 0 workers."""
    if num_workers <= 0 or not budget:
        return None
    per_element = 0 if decode == "none" else 9 if decode == "text" else 5
    return BatchRing.for_budget(num_workers, budget, per_element, (prefetch_factor or 2) + 2)
