"""Where streamed decoder layers live off the compute device, and how one reaches a slot on it before it runs.

A streamed layer is one contiguous byte image (engine.weights.streaming.layer_layout says where each tensor lies in it).
A copy engine holds every streamed image off-device and `num_slots` slots of `slot_bytes` on the compute device,
and moves one whole image into one slot per copy (one copy per layer, never one per tensor).

The protocol, driven by engine.weights.streaming.LayerStreamer, per slot:
    issue(layer, slot)  start copying the layer's image into the slot; the copy does not start before the slot's
                        last release (its previous occupant has finished computing)
    wait(slot)          work issued on the compute device after this sees the copy into the slot complete
    release(slot)       the compute issued so far is the last to read the slot's occupant; a later issue may
                        overwrite it
On CUDA these are stream/event operations and the host never waits on the device; on the CPU a copy is done when
issue returns, so wait and release only keep the protocol (and the scheduler) the same.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from abc import ABC, abstractmethod
from pathlib import Path

import torch

PAGE = 4096  # each image starts on its own page of the layer file: a layer's pages are read and dropped together


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _image_offsets(image_bytes: dict[int, int], alignment: int) -> tuple[dict[int, int], int]:
    """({layer: offset of its image}, total bytes), images in layer order, each at a multiple of `alignment`."""
    offsets, end = {}, 0
    for layer in sorted(image_bytes):
        offsets[layer] = end
        end = _aligned(end + image_bytes[layer], alignment)
    return offsets, end


class CopyEngine(ABC):
    """Streamed images off-device, slots on `device`, and the issue / wait / release protocol above."""

    device: torch.device
    num_slots: int
    slot_bytes: int = 0

    @abstractmethod
    def setup(self, image_bytes: dict[int, int], slot_bytes: int) -> None:
        """Room for the images ({layer index: bytes}) and the slots (each `slot_bytes`); called once."""

    @abstractmethod
    def store(self, layer: int, image: torch.Tensor) -> None:
        """Write a layer's image (uint8 [bytes], on any device) where it will live; once per layer, after setup."""

    @abstractmethod
    def host(self, layer: int) -> torch.Tensor:
        """The layer's image as held off-device: uint8 [bytes], on the CPU."""

    @abstractmethod
    def slot(self, slot: int) -> torch.Tensor:
        """A slot: uint8 [slot_bytes] on the compute device."""

    @abstractmethod
    def issue(self, layer: int, slot: int) -> None: ...

    @abstractmethod
    def wait(self, slot: int) -> None: ...

    @abstractmethod
    def release(self, slot: int) -> None: ...

    def slots_bytes(self) -> int:
        """Bytes the slots hold on the compute device."""
        return self.num_slots * self.slot_bytes

    def close(self) -> None:
        """Free the images and the slots (nothing may point into them any more)."""


def _check_num_slots(num_slots: int) -> None:
    if num_slots < 1:
        raise ValueError(f"num_slots must be at least 1, got {num_slots}")


class CpuCopyEngine(CopyEngine):
    """Streamed images in one file in `folder`, memory-mapped, so the OS can drop a layer's pages once it has
    been copied (for machines with less RAM than the model); a RAM arena of `num_slots` slots.

    The file is made at setup and deleted by close(), or when the engine is garbage-collected. Copies are
    synchronous: issue returns with the slot filled."""

    def __init__(self, folder: str | os.PathLike, num_slots: int = 2):
        _check_num_slots(num_slots)
        self.device = torch.device("cpu")
        self.num_slots = num_slots
        self.folder = Path(folder)
        self.path: Path | None = None
        self._offsets: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._mapped: torch.Tensor | None = None  # uint8 [file bytes], MAP_SHARED over the file
        self._arena: torch.Tensor | None = None  # uint8 [num_slots, slot_bytes]

    def setup(self, image_bytes: dict[int, int], slot_bytes: int) -> None:
        assert self._mapped is None, "setup runs once"
        self._sizes = dict(image_bytes)
        self._offsets, total = _image_offsets(self._sizes, PAGE)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kvboost-layers-", suffix=".bin", dir=self.folder)
        self.path = Path(name)
        weakref.finalize(self, Path.unlink, self.path, missing_ok=True)
        try:
            os.ftruncate(fd, max(total, 1))
        finally:
            os.close(fd)
        with torch.inference_mode(False):  # normal tensors: copied into in place, in or out of inference mode
            # shared=True: the mapping is the file itself (writes go to the page cache, clean pages can be dropped)
            self._mapped = torch.from_file(str(self.path), shared=True, size=max(total, 1), dtype=torch.uint8)
            self.slot_bytes = slot_bytes
            self._arena = torch.empty(self.num_slots, slot_bytes, dtype=torch.uint8)

    def store(self, layer: int, image: torch.Tensor) -> None:
        assert image.dtype == torch.uint8 and image.numel() == self._sizes[layer], (image.shape, self._sizes[layer])
        self.host(layer).copy_(image)

    def host(self, layer: int) -> torch.Tensor:
        start = self._offsets[layer]
        return self._mapped[start:start + self._sizes[layer]]

    def region(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of the layer's image in the file."""
        return self._offsets[layer], self._sizes[layer]

    def slot(self, slot: int) -> torch.Tensor:
        return self._arena[slot]

    def issue(self, layer: int, slot: int) -> None:
        self._arena[slot, :self._sizes[layer]].copy_(self.host(layer))

    def wait(self, slot: int) -> None:
        pass  # issue copied synchronously

    def release(self, slot: int) -> None:
        pass  # the CPU computed synchronously: the layer is done when its forward returns

    def close(self) -> None:
        self._mapped = self._arena = None
        self.slot_bytes = 0
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class CudaCopyEngine(CopyEngine):
    """Streamed images in page-locked host memory, `num_slots` slots on a CUDA device, copies on a stream of
    their own, ordered against the compute stream by two events per slot: `copied` (recorded on the copy stream
    after the copy into the slot) and `freed` (recorded on the compute stream after the slot's occupant ran).

    The images are views of one host slab page-locked in place (cudaHostRegister): torch's pinned allocator
    rounds every allocation up to a power of two, which for a slab of many GB can waste nearly as much again.
    Where registering fails the slab comes from the pinned allocator instead."""

    def __init__(self, device: torch.device | str = "cuda", num_slots: int = 2):
        _check_num_slots(num_slots)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots = num_slots
        self._offsets: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._slab: torch.Tensor | None = None  # uint8 [total] page-locked, on the host
        self._registered = False
        self._slots: torch.Tensor | None = None  # uint8 [num_slots, slot_bytes] on the device
        self._stream = torch.cuda.Stream(self.device)
        self._copied = [torch.cuda.Event() for _ in range(num_slots)]
        self._freed = [torch.cuda.Event() for _ in range(num_slots)]

    def setup(self, image_bytes: dict[int, int], slot_bytes: int) -> None:
        assert self._slab is None, "setup runs once"
        self._sizes = dict(image_bytes)
        self._offsets, total = _image_offsets(self._sizes, PAGE)
        with torch.inference_mode(False):
            self._slab = torch.empty(max(total, 1), dtype=torch.uint8)
            cudart = torch.cuda.cudart()
            self._registered = int(cudart.cudaHostRegister(self._slab.data_ptr(), self._slab.numel(), 0)) == 0
            if not self._registered:
                self._slab = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
            self.slot_bytes = slot_bytes
            self._slots = torch.empty(self.num_slots, slot_bytes, dtype=torch.uint8, device=self.device)

    def store(self, layer: int, image: torch.Tensor) -> None:
        assert image.dtype == torch.uint8 and image.numel() == self._sizes[layer], (image.shape, self._sizes[layer])
        self.host(layer).copy_(image)

    def host(self, layer: int) -> torch.Tensor:
        start = self._offsets[layer]
        return self._slab[start:start + self._sizes[layer]]

    def slot(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    def issue(self, layer: int, slot: int) -> None:
        with torch.cuda.stream(self._stream):
            # An event never recorded makes this wait a no-op: a slot's first copy waits for nothing.
            self._stream.wait_event(self._freed[slot])
            self._slots[slot, :self._sizes[layer]].copy_(self.host(layer), non_blocking=True)
            self._copied[slot].record(self._stream)

    def wait(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._copied[slot])

    def release(self, slot: int) -> None:
        self._freed[slot].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        if self._slab is None:
            return
        torch.cuda.synchronize(self.device)  # no copy or kernel still reads the slab or the slots
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._slab.data_ptr())
        self._slab = self._slots = None
        self.slot_bytes = 0
