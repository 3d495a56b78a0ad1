"""The engine wire (vllite.plugins.engine_proc.serial): tensors and arrays inline and zero-copy, strict decoding,
fuzzing with hostile frames."""

from __future__ import annotations

import contextlib
import enum
import random
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllite.plugins.engine_proc.serial import (
    EXT_ARRAY_AUX,
    EXT_ARRAY_INLINE,
    DecodeError,
    MsgpackDecoder,
    MsgpackEncoder,
)
from vllite.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    UtilityOutput,
    UtilityResult,
)
from vllite.sampling_params import SamplingParams


def roundtrip(obj, t=None, threshold=256):
    frames = MsgpackEncoder(threshold).encode(obj)
    return MsgpackDecoder(t).decode(frames), frames


# ---------------------------------------------------------------------------- tensors and arrays
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
@pytest.mark.parametrize("numel", [0, 3, 1000])
def test_tensor_roundtrip_every_dtype(dtype, numel):
    t = (torch.arange(numel) % 7).to(dtype) if dtype != torch.bool else torch.arange(numel) % 2 == 0
    out, frames = roundtrip({"t": t})
    assert out["t"].dtype == dtype and out["t"].shape == t.shape
    assert torch.equal(out["t"], t)
    assert len(frames) == (2 if t.nbytes >= 256 else 1)


def test_small_tensor_is_inline_ext3_and_large_goes_to_aux_frame():
    small = torch.arange(4, dtype=torch.int32)  # 16 bytes
    frames = MsgpackEncoder().encode(small)
    assert len(frames) == 1
    ext = msgspec.msgpack.decode(frames[0], ext_hook=lambda code, data: code)
    assert ext == EXT_ARRAY_INLINE == 3

    large = torch.arange(64, dtype=torch.float32)  # exactly 256 bytes: not below the threshold
    frames = MsgpackEncoder().encode(large)
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == 256
    assert msgspec.msgpack.decode(frames[0], ext_hook=lambda code, data: code) == EXT_ARRAY_AUX


def test_aux_frame_is_zero_copy_on_encode_and_decode():
    t = torch.arange(1000, dtype=torch.float32)
    doubled = t * 2
    frames = MsgpackEncoder().encode([t, doubled])
    assert len(frames) == 3
    # the frame aliases the tensor's memory
    t[0] = 42.0
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == 42.0
    # decoding from a writable buffer aliases it too
    buf = bytearray(frames[1])
    out = MsgpackDecoder().decode([frames[0], buf, frames[2]])
    buf[:4] = np.float32(7.0).tobytes()
    assert out[0][0].item() == 7.0
    assert torch.equal(out[1], doubled)
    # share_mem=False always copies
    buf2 = bytearray(frames[1])
    copied = MsgpackDecoder(share_mem=False).decode([frames[0], buf2, frames[2]])
    buf2[:4] = np.float32(9.0).tobytes()
    assert copied[0][0].item() == 42.0


def test_readonly_frames_give_writable_tensors():
    t = torch.arange(500, dtype=torch.int64)
    frames = [bytes(f) for f in MsgpackEncoder().encode(t)]
    out = MsgpackDecoder().decode(frames)
    out[0] = -1  # would fail or warn if it aliased read-only bytes
    assert torch.equal(out[1:], t[1:])


def test_noncontiguous_and_0d_tensors():
    t = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()[::2]
    out, _ = roundtrip(t)
    assert torch.equal(out, t)
    scalar = torch.tensor(3.5)
    out, _ = roundtrip(scalar)
    assert out.shape == () and out.item() == 3.5


@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<i8", "|u1", "|b1", "<c16", "<f2"])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 40), (2, 3, 50)])
def test_ndarray_roundtrip(dtype, shape):
    a = (np.arange(int(np.prod(shape))) % 5).astype(dtype).reshape(shape)
    out, _ = roundtrip(a)
    assert out.dtype == a.dtype and out.shape == a.shape
    np.testing.assert_array_equal(out, a)


def test_ndarray_noncontiguous_and_numpy_scalars():
    a = np.arange(400, dtype=np.int32).reshape(20, 20)[:, ::3]
    out, _ = roundtrip({"a": a, "s": np.float32(1.5), "i": np.int64(7)})
    np.testing.assert_array_equal(out["a"], a)
    assert out["s"] == 1.5 and out["i"] == 7


def test_encode_into_reuses_buffer():
    enc = MsgpackEncoder()
    buf = bytearray(1 << 16)
    frames = enc.encode_into({"x": [1, 2, 3], "t": torch.ones(100)}, buf)
    assert frames[0] is buf
    assert len(frames) == 2
    out = MsgpackDecoder().decode(frames)
    assert out["x"] == [1, 2, 3] and torch.equal(out["t"], torch.ones(100))
    frames2 = enc.encode_into("short", buf)
    assert frames2 == [buf] and MsgpackDecoder().decode(frames2) == "short"


def test_threshold_zero_sends_everything_out_of_band():
    frames = MsgpackEncoder(size_threshold=0).encode([torch.ones(1), np.zeros(2)])
    assert len(frames) == 3
    with pytest.raises(ValueError, match="size_threshold"):
        MsgpackEncoder(size_threshold=-1)


# ---------------------------------------------------------------------------- other types
class Color(enum.Enum):
    RED = "red"


def test_sets_enums_and_nested_params():
    params = SamplingParams(temperature=0.5, stop=["\n"], seed=3, logit_bias={5: 1.5})
    obj = EngineCoreRequest("r", [1, 2], params, 2, 1.0)
    out, frames = roundtrip(obj, EngineCoreRequest)
    assert out == obj and out.sampling_params.logit_bias == {5: 1.5}
    assert len(frames) == 1
    out, _ = roundtrip({"s": {1, 2}}, dict[str, set[int]])
    assert out == {"s": {1, 2}}
    out, _ = roundtrip(Color.RED, Color)
    assert out is Color.RED


def test_unknown_types_raise_type_error_never_pickle():
    class Custom:
        pass

    enc = MsgpackEncoder()
    bad_values = [
        Custom(),
        object(),
        lambda: 1,
        np.array([object()], dtype=object),
        np.zeros(2, dtype=[("a", "<i4")]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        torch.ones(2, 2).to_sparse(),
        torch.zeros(2, dtype=torch.float8_e4m3fn),
    ]
    for bad in bad_values:
        with pytest.raises(TypeError):
            enc.encode({"x": bad})


def test_utility_result_with_tensor():
    out, _ = roundtrip(UtilityOutput(7, result=UtilityResult({"w": torch.ones(100)})), UtilityOutput)
    assert out.call_id == 7 and torch.equal(out.result.result["w"], torch.ones(100))


def test_import_does_not_load_torch_or_numpy():
    code = (
        "import sys, vllite.plugins.engine_proc.serial, vllite.protocol; "
        "print('torch' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---------------------------------------------------------------------------- hostile input
def _ext(code: int, payload: tuple) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, msgspec.msgpack.encode(payload)))


@pytest.mark.parametrize(
    "frames",
    [
        [_ext(EXT_ARRAY_INLINE, (0, "object", (1,), b"\0" * 8))],  # dtype not allowed
        [_ext(EXT_ARRAY_INLINE, (0, "float32; import os", (1,), b"\0" * 4))],
        [_ext(EXT_ARRAY_INLINE, (1, "O", (1,), b"\0" * 8))],  # numpy object dtype
        [_ext(EXT_ARRAY_INLINE, (1, "V8", (1,), b"\0" * 8))],
        [_ext(EXT_ARRAY_INLINE, (1, "[('a', '<i4')]", (1,), b"\0" * 4))],
        [_ext(EXT_ARRAY_INLINE, (1, "not a dtype", (1,), b"\0" * 4))],
        [_ext(EXT_ARRAY_INLINE, (0, "float32", (3,), b"\0" * 4))],  # shape/size mismatch
        [_ext(EXT_ARRAY_INLINE, (0, "float32", (-1,), b"\0" * 4))],
        [_ext(EXT_ARRAY_INLINE, (0, "float32", (1 << 40, 1 << 40), b"\0" * 4))],
        [_ext(EXT_ARRAY_INLINE, (0, "float32", (0, 1 << 30, 1 << 30), b""))],  # zero elements, huge strides
        [_ext(EXT_ARRAY_INLINE, (1, "<f4", (0, 1 << 30, 1 << 30), b""))],
        [_ext(EXT_ARRAY_INLINE, (1, "<M8[D]", (1,), b"\0" * 8))],
        [_ext(EXT_ARRAY_INLINE, (9, "float32", (1,), b"\0" * 4))],  # unknown kind
        [_ext(EXT_ARRAY_AUX, (0, "float32", (1,), 0))],  # missing aux frame
        [_ext(EXT_ARRAY_AUX, (0, "float32", (1,), -1)), b"\0" * 4],
        [_ext(EXT_ARRAY_AUX, (0, "float32", (1,), 5)), b"\0" * 4],
        [_ext(EXT_ARRAY_INLINE, ("x",))],  # malformed header
        [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"pickle!"))],  # pickle code: unknown here
        [b"\x91" * 100_000],  # deep nesting
        [],
        [b""],
        [12345],
    ],
)
def test_hostile_frames_raise_decode_error(frames):
    with pytest.raises(DecodeError):
        MsgpackDecoder().decode(frames)


def test_invalid_sampling_params_on_the_wire_is_validation_error():
    raw = msgspec.msgpack.encode(["r", [1], {"temperature": -1.0}, None, 0.0])
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        MsgpackDecoder(EngineCoreRequest).decode(raw)


def _valid_messages() -> list[tuple[type, list[bytes]]]:
    enc = MsgpackEncoder(size_threshold=64)
    lt = LogprobsTensors(torch.arange(40).reshape(10, 4), torch.randn(10, 4), torch.arange(10))
    outs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [1, 2], LogprobsLists([[1, 2]], [[-0.1, -2.0]], [1]), lt, FinishReason.STOP, "x"),
            EngineCoreOutput("b", [3]),
        ],
        finished_requests={"a"},
        utility_output=UtilityOutput(1, result=UtilityResult(np.arange(30))),
    )
    req = EngineCoreRequest("r", [1, 2, 3], SamplingParams(stop=["a"], n=2, seed=1), 0, 1.0, cache_salt="s")
    return [
        (EngineCoreOutputs, [bytes(f) for f in enc.encode(outs)]),
        (EngineCoreRequest, [bytes(f) for f in enc.encode(req)]),
    ]


def _decode_only_decode_errors(t, frames) -> None:
    for decoder in (MsgpackDecoder(t), MsgpackDecoder()):
        with contextlib.suppress(DecodeError):
            decoder.decode(frames)


def test_fuzz_bit_flips_and_truncations_of_valid_frames():
    rng = random.Random(1234)
    for t, frames in _valid_messages():
        main = frames[0]
        for cut in range(len(main)):
            _decode_only_decode_errors(t, [main[:cut], *frames[1:]])
        for _ in range(1500):
            mutated = bytearray(main)
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(len(mutated))
                mutated[pos] ^= 1 << rng.randrange(8)
            aux = list(frames[1:])
            if aux and rng.random() < 0.3:
                aux[0] = aux[0][: rng.randrange(len(aux[0]) + 1)]
            _decode_only_decode_errors(t, [bytes(mutated), *aux])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=2))
def test_fuzz_random_bytes(main, aux):
    _decode_only_decode_errors(EngineCoreOutputs, [main, *aux])
    _decode_only_decode_errors(EngineCoreRequest, [main, *aux])


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([EXT_ARRAY_INLINE, EXT_ARRAY_AUX, 0, 1, 2, 127]),
    st.integers(0, 3),
    st.sampled_from(["float32", "bfloat16", "<f4", ">i8", "O", "bool", "|b1", "", "torch.float32"]),
    st.lists(st.integers(-3, 1 << 33), max_size=4),
    st.one_of(st.binary(max_size=40), st.integers(-2, 3)),
)
def test_fuzz_array_headers(code, kind, dtype, shape, data):
    frames = [msgspec.msgpack.encode(msgspec.msgpack.Ext(code, msgspec.msgpack.encode([kind, dtype, shape, data])))]
    frames.append(b"\0" * 16)
    _decode_only_decode_errors(None, frames)
