"""Host/device tensor pairs with vLLM's staged-tensor API (``.gpu``, ``.cpu``, ``.np``).

vLLM's model runner shares per-slot state with slot-interface processors through two buffer kinds, and
processors use the same kinds for their own per-slot settings:

- :class:`UvaBackedTensor`: the host copy is the source of truth. Write ``.np`` (or ``.cpu``) on the host,
  then publish with ``copy_to_uva()``, after which ``.gpu`` holds the values on the device.
- :class:`StagedWriteTensor`: the device copy is what kernels read. Writes are staged on the host with
  ``stage_write`` / ``stage_write_elem`` and land together in ``apply_write()``.

Here both keep a host tensor (``.cpu``, with ``.np`` its numpy view: the same memory) and a device tensor
(``.gpu``). On a CPU device the two are one tensor, so ``.gpu`` is always current. ``.gpu`` names the device
copy whatever the device is, as in vLLM. A buffer built without a device goes to the device of the engine
building the processor (see :func:`buffer_device`), else to CUDA when available, else to the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("vllite_buffer_device", default=None)


@contextlib.contextmanager
def buffer_device(device: torch.device) -> Iterator[None]:
    """Within the block, buffers built without a device go to ``device`` (the engine sets this while it
    constructs a slot-interface processor, so its buffers land where the logits are)."""
    token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def default_buffer_device() -> torch.device:
    """The device of a buffer built without one: the engine's (inside :func:`buffer_device`), else CUDA when
    available, else the CPU."""
    import torch

    device = _DEVICE.get()
    if device is not None:
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _host_zeros(size: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.zeros(size, dtype=dtype, device="cpu")


class UvaBackedTensor:
    """A host buffer (``cpu``, ``np``: the source of truth) published to the device (``gpu``) on request.

    Write the host copy, then call :meth:`copy_to_uva` once the step's writes are done; ``gpu`` is then the
    device copy (its first ``n`` rows when ``n`` is given). ``max_concurrency`` is accepted for vLLM
    compatibility and unused. ``np`` is a view of ``cpu``, never replaced, so keeping it is safe.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        max_concurrency: int | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        import torch

        self.dtype = dtype
        self.device = torch.device(device) if device is not None else default_buffer_device()
        self.cpu = _host_zeros(size, dtype)
        self.np = self.cpu.numpy()
        self.gpu = self.copy_to_uva()

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Publishes the host copy (its first ``n`` rows, or all) to ``gpu`` and returns it."""
        host = self.cpu if n is None else self.cpu[:n]
        self.gpu = host if self.device.type == "cpu" else host.to(self.device)
        return self.gpu


class StagedWriteTensor:
    """A device tensor (``gpu``) written through staged host-side writes, with a host mirror (``cpu``, ``np``).

    ``stage_write(index, start, values)`` stages ``values`` for row ``index`` from column ``start`` (for a 1-D
    tensor: from element ``index + start``); ``stage_write_elem(index, value)`` stages one element;
    ``apply_write()`` writes every staged value to the host mirror and the device copy at once (one
    host-to-device transfer). Nothing staged is visible before ``apply_write``. ``max_concurrency`` and
    ``uva_instead_of_gpu`` are accepted for vLLM compatibility and unused.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        max_concurrency: int | None = None,
        uva_instead_of_gpu: bool = False,
    ) -> None:
        import torch

        self.num_rows = size if isinstance(size, int) else size[0]
        self.dtype = dtype
        self.device = torch.device(device)
        self.cpu = _host_zeros(size, dtype)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if self.device.type == "cpu" else torch.zeros(size, dtype=dtype, device=self.device)
        self._staged: list[tuple[int, int, list[Any]]] = []

    def stage_write(self, index: int, start: int, x: Iterable[int] | Iterable[float]) -> None:
        """Stages ``x`` for row ``index`` from column ``start``; applied by :meth:`apply_write`."""
        values = list(x)
        if values:
            self._staged.append((index, start, values))

    def stage_write_elem(self, index: int, x: int | float) -> None:
        """Stages one value at row ``index`` (column 0; for a 1-D tensor the element ``index``)."""
        self._staged.append((index, 0, [x]))

    def clear_staged_writes(self) -> None:
        """Drops the staged writes without applying them."""
        self._staged.clear()

    def apply_write(self) -> None:
        """Applies the staged writes to the host mirror and the device copy, then forgets them."""
        if not self._staged:
            return
        import torch

        flat_host = self.cpu.view(-1)
        row_len = self.cpu.shape[1] if self.cpu.dim() > 1 else 1
        positions: list[int] = []
        values: list[Any] = []
        for index, start, chunk in self._staged:
            first = index * row_len + start
            positions.extend(range(first, first + len(chunk)))
            values.extend(chunk)
        self._staged.clear()
        where = torch.tensor(positions, dtype=torch.long)
        flat_host[where] = torch.tensor(values, dtype=self.dtype)
        if self.gpu is not self.cpu:
            self.gpu.view(-1).index_copy_(0, where.to(self.device), flat_host[where].to(self.device))
