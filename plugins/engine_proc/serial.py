"""msgpack serialization for the engine-core wire: msgspec Structs plus zero-copy tensors, never pickle.

``MsgpackEncoder.encode(obj)`` returns frames ``[main, *aux]``. Torch tensors and numpy arrays travel as raw
buffers inside a msgpack extension:

* smaller than ``size_threshold`` bytes: inline, ext code ``EXT_ARRAY_INLINE`` holding
  ``[kind, dtype, shape, raw_bytes]``;
* otherwise: ext code ``EXT_ARRAY_AUX`` holding ``[kind, dtype, shape, index]``, and the raw buffer is
  appended as its own frame (``frames[1 + index]``), a memoryview of the tensor's memory (no copy).

The extension is self-describing, so tensors round-trip inside ``Any``-typed fields (``LogprobsTensors``).
Decoding is strict: dtypes come from a fixed allow-list, shapes must match the buffer size, frame indices must
exist. Anything malformed raises :data:`DecodeError` (``msgspec.DecodeError``; ``msgspec.ValidationError`` is
a subclass), never anything else, and no code from the wire is ever run. Types the encoder does not know raise
``TypeError``. Importing this module does not import torch or numpy: they are imported when first seen.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = [
    "EXT_ARRAY_AUX",
    "EXT_ARRAY_INLINE",
    "DecodeError",
    "MsgpackDecoder",
    "MsgpackEncoder",
]

DecodeError = msgspec.DecodeError
"""What a malformed or hostile frame raises (``msgspec.ValidationError`` derives from it)."""

EXT_ARRAY_INLINE = 3
EXT_ARRAY_AUX = 4
DEFAULT_SIZE_THRESHOLD = 256
_MAX_NDIM = 32

# kind tags inside the extension payload
_KIND_TORCH = 0
_KIND_NUMPY = 1

# Torch dtypes that may cross the wire, by their name without the "torch." prefix.
_TORCH_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_NUMPY_KINDS = "biufc"
# numpy dtype strings allowed on the wire: byte order, kind, item size (``arr.dtype.str`` of plain numbers).
_NUMPY_DTYPE_RE = re.compile(r"[<>|=][biufc](1|2|4|8|16)")
_MAX_ELEMENTS = 1 << 48

_Header = tuple[int, str, tuple[int, ...], bytes]
_AuxHeader = tuple[int, str, tuple[int, ...], int]
_inline_decoder = msgspec.msgpack.Decoder(_Header)
_aux_decoder = msgspec.msgpack.Decoder(_AuxHeader)
_header_encoder = msgspec.msgpack.Encoder()


def _is_torch_tensor(obj: object) -> bool:
    if "torch" not in sys.modules:
        return False
    import torch

    return isinstance(obj, torch.Tensor)


def _is_ndarray(obj: object) -> bool:
    if "numpy" not in sys.modules:
        return False
    import numpy as np

    return isinstance(obj, np.ndarray)


def _is_numpy_scalar(obj: object) -> bool:
    if "numpy" not in sys.modules:
        return False
    import numpy as np

    return isinstance(obj, np.generic) and obj.dtype.kind in _NUMPY_KINDS


class MsgpackEncoder:
    """Encodes objects to ``[main_buffer, *aux_buffers]``; large tensors and arrays go out zero-copy.

    Not thread-safe: use one encoder per thread. The aux frames alias the tensors' memory, so the caller must
    keep the encoded object alive until the frames are sent.
    """

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD) -> None:
        if size_threshold < 0:
            raise ValueError(f"size_threshold must be >= 0, got {size_threshold}.")
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[bytes | memoryview] | None = None

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        """Encodes ``obj``; returns the main msgpack buffer followed by one frame per large tensor."""
        aux: list[bytes | memoryview] = []
        self._aux = aux
        try:
            main = self._encoder.encode(obj)
        finally:
            self._aux = None
        return [main, *aux]

    def encode_into(self, obj: Any, buf: bytearray) -> list[bytes | memoryview | bytearray]:
        """Like :meth:`encode`, but writes the main buffer into ``buf`` (resized as needed), reusing it."""
        aux: list[bytes | memoryview] = []
        self._aux = aux
        try:
            self._encoder.encode_into(obj, buf)
        finally:
            self._aux = None
        return [buf, *aux]

    # ------------------------------------------------------------------ hooks
    def _enc_hook(self, obj: Any) -> Any:
        if _is_torch_tensor(obj):
            return self._encode_tensor(obj)
        if _is_ndarray(obj):
            return self._encode_ndarray(obj)
        if _is_numpy_scalar(obj):
            return obj.item()
        if isinstance(obj, slice):
            return (obj.start, obj.stop, obj.step)
        raise TypeError(
            f"Object of type {type(obj).__name__} is not serializable by vllite.plugins.engine_proc.serial "
            "(supported: msgspec-native types, msgspec Structs, torch tensors, numpy arrays)."
        )

    def _encode_tensor(self, t: Any) -> msgspec.msgpack.Ext:
        import torch

        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _TORCH_DTYPES or t.layout != torch.strided:
            raise TypeError(
                f"Tensors of dtype {t.dtype} and layout {t.layout} are not serializable on the engine wire "
                "(dense tensors of plain number dtypes only)."
            )
        shape = tuple(t.shape)
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        # Flat uint8 view of contiguous memory; .numpy() shares it and keeps the tensor alive.
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        return self._pack(_KIND_TORCH, dtype, shape, raw)

    def _encode_ndarray(self, arr: Any) -> msgspec.msgpack.Ext:
        import numpy as np

        if not _NUMPY_DTYPE_RE.fullmatch(arr.dtype.str):
            raise TypeError(f"numpy arrays of dtype {arr.dtype} are not serializable on the engine wire.")
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        return self._pack(_KIND_NUMPY, arr.dtype.str, tuple(arr.shape), raw)

    def _pack(self, kind: int, dtype: str, shape: tuple[int, ...], raw: Any) -> msgspec.msgpack.Ext:
        if raw.nbytes < self.size_threshold or self._aux is None:
            return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, _header_encoder.encode((kind, dtype, shape, raw.tobytes())))
        index = len(self._aux)
        self._aux.append(memoryview(raw))
        return msgspec.msgpack.Ext(EXT_ARRAY_AUX, _header_encoder.encode((kind, dtype, shape, index)))


class MsgpackDecoder:
    """Decodes frames made by :class:`MsgpackEncoder`, into type ``t`` (validated) or plain objects.

    With ``share_mem=True`` (default) large tensors alias their aux frame when it is writable; read-only
    frames (``bytes``) are copied for torch (numpy arrays alias them read-only).
    Errors: only :data:`DecodeError`. Not thread-safe: use one decoder per thread.
    """

    def __init__(self, t: type | Any | None = None, *, share_mem: bool = True) -> None:
        self.share_mem = share_mem
        self._decoder = msgspec.msgpack.Decoder(Any if t is None else t, ext_hook=self._ext_hook)
        self._aux: Sequence[Any] = ()

    def decode(self, frames: bytes | bytearray | memoryview | Sequence[Any]) -> Any:
        """Decodes one message: a single buffer, or a sequence ``[main, *aux]`` of buffers (or zmq Frames)."""
        aux: Sequence[Any]
        if isinstance(frames, (bytes, bytearray, memoryview)):
            first: Any = frames
            aux = ()
        else:
            if len(frames) == 0:
                raise DecodeError("No frames to decode.")
            first, aux = frames[0], frames[1:]
        main = _as_buffer(first)
        self._aux = aux
        try:
            return self._decoder.decode(main)
        except DecodeError:
            raise
        except (RecursionError, ValueError, TypeError, OverflowError, MemoryError, IndexError) as e:
            raise DecodeError(f"Malformed message: {type(e).__name__}: {e}") from None
        finally:
            self._aux = ()

    # ------------------------------------------------------------------ hooks
    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_ARRAY_INLINE:
            kind, dtype, shape, raw = _inline_decoder.decode(data)
            return _build_array(kind, dtype, shape, bytearray(raw), share=True)
        if code == EXT_ARRAY_AUX:
            kind, dtype, shape, index = _aux_decoder.decode(data)
            if not 0 <= index < len(self._aux):
                raise DecodeError(f"Tensor refers to frame {index + 1}, but the message has {len(self._aux) + 1}.")
            return _build_array(kind, dtype, shape, _as_buffer(self._aux[index]), share=self.share_mem)
        raise DecodeError(f"Unknown msgpack extension type {code}.")


def _as_buffer(frame: Any) -> bytes | bytearray | memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    if buffer is not None:
        return buffer
    raise DecodeError(f"Frames must be bytes-like, got {type(frame).__name__}.")


def _check_shape(shape: tuple[int, ...], itemsize: int, nbytes: int) -> None:
    if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
        raise DecodeError(f"Invalid tensor shape {shape}.")
    count = bound = 1
    for d in shape:
        count *= d
        bound *= max(d, 1)
    if bound > _MAX_ELEMENTS:
        raise DecodeError(f"Tensor shape {shape} is too large.")
    if count * itemsize != nbytes:
        raise DecodeError(f"Tensor of shape {shape} needs {count * itemsize} bytes, the buffer has {nbytes}.")


def _build_array(kind: int, dtype: str, shape: tuple[int, ...], buf: Any, *, share: bool) -> Any:
    view = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    if kind == _KIND_NUMPY:
        import numpy as np

        if not _NUMPY_DTYPE_RE.fullmatch(dtype):
            raise DecodeError(f"numpy dtype {dtype!r} is not allowed on the wire.")
        np_dtype = np.dtype(dtype)
        _check_shape(shape, np_dtype.itemsize, view.nbytes)
        return np.frombuffer(view, dtype=np_dtype).reshape(shape)
    if kind == _KIND_TORCH:
        if dtype not in _TORCH_DTYPES:
            raise DecodeError(f"torch dtype {dtype!r} is not allowed on the wire.")
        import torch

        torch_dtype = getattr(torch, dtype)
        _check_shape(shape, torch_dtype.itemsize, view.nbytes)
        if view.nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        if view.readonly or not share:
            view = memoryview(bytearray(view))
        return torch.frombuffer(view, dtype=torch.uint8).view(torch_dtype).reshape(shape)
    raise DecodeError(f"Unknown array kind {kind}.")
