"""Wire codec: round trips, every malformed-frame case, schema validation, memory rows, no torch import."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from moa_core import protocol as P
from tests.helpers import run_blocked

ROOT = Path(__file__).resolve().parents[1]


def raw_frame(header: dict, payload: bytes = b"", magic: bytes = P.MAGIC) -> bytes:
    """A frame built by hand, bypassing encode's checks."""
    h = json.dumps(header).encode()
    return magic + struct.pack("<I", len(h)) + h + payload


def header(**over) -> dict:
    base = {"type": P.PING, "v": P.PROTOCOL_VERSION, "fields": {}, "tensors": []}
    return {**base, **over}


def expect(exc_type: type, code: str, frame) -> P.ProtocolError:
    with pytest.raises(exc_type) as info:
        P.decode(frame)
    assert info.value.code == code
    return info.value


# ---- round trips --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", P.DTYPES)
def test_round_trip_every_dtype(dtype):
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.integer):
        a = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, (3, 5), dtype=dtype, endpoint=True)
    else:
        a = (rng.standard_normal((3, 5)) * 100).astype(dtype)
    frame = P.encode(P.VERIFY, {"seq": 7, "name": "é"}, {"a": a, "empty": np.zeros((0, 4), dtype), "s": a[0, 0]})
    msg = P.decode(frame)
    assert (msg.type, msg.v, msg.fields) == (P.VERIFY, P.PROTOCOL_VERSION, {"seq": 7, "name": "é"})
    np.testing.assert_array_equal(msg.tensors["a"], a)
    assert msg.tensors["a"].dtype == np.dtype(dtype) and msg.tensors["a"].dtype.isnative
    assert msg.tensors["empty"].shape == (0, 4) and msg.tensors["s"].shape == ()
    assert not msg.tensors["a"].flags.writeable


def test_mixed_tensors_aligned_big_endian_and_views():
    tensors = {"u8": np.arange(3, dtype=np.uint8), "i64be": np.arange(4, dtype=">i8"),
               "t": np.arange(10, dtype=np.int32)[::2], "h": np.ones((2, 3), np.float16)}
    frame = P.encode(P.PREFILLED, {"n": np.int64(3), "l": np.arange(2)}, tensors)
    for buf in (frame, bytearray(frame), memoryview(frame)):
        msg = P.decode(buf)
        assert msg.fields == {"n": 3, "l": [0, 1]}
        for name, arr in tensors.items():
            np.testing.assert_array_equal(msg.tensors[name], arr)
            assert msg.tensors[name].flags.aligned and not msg.tensors[name].flags.writeable
    assert P.decode(P.encode(P.CLOSE)) == P.Message(P.CLOSE, {}, {}, P.PROTOCOL_VERSION)


def test_encode_rejects_bad_input():
    with pytest.raises(P.TensorMismatch):
        P.encode(P.VERIFY, tensors={"x": np.zeros(2, np.float64)})
    with pytest.raises(P.TensorMismatch):
        P.encode(P.VERIFY, tensors={"x": np.zeros(2, bool)})
    with pytest.raises(P.UnknownType):
        P.encode("bye")
    with pytest.raises(ValueError):
        P.encode(P.VERIFY, {"temperature": float("nan")})


# ---- malformed frames ---------------------------------------------------------------------------------------
def test_bad_magic_and_truncation():
    good = P.encode(P.VERIFY, {"seq": 1}, {"tokens": np.arange(4, dtype=np.int32)})
    expect(P.MalformedFrame, "malformed", b"XXXX" + good[4:])
    expect(P.MalformedFrame, "malformed", good[:6])
    header_len = struct.unpack_from("<I", good, 4)[0]
    expect(P.MalformedFrame, "malformed", good[:8 + header_len - 3])  # truncated header
    expect(P.MalformedFrame, "malformed", good[:-1])  # truncated payload
    expect(P.MalformedFrame, "malformed", "text")


@pytest.mark.parametrize("body", [b"[1, 2]", b'"ping"', b"{not json", b"\xff\xfe", b'{"type":"ping","v":1,"x":NaN}'])
def test_header_not_a_json_object(body):
    expect(P.MalformedFrame, "malformed", P.MAGIC + struct.pack("<I", len(body)) + body)


@pytest.mark.parametrize("over", [{"v": None}, {"v": "1"}, {"type": 3}, {"fields": []}, {"tensors": {}}])
def test_bad_header_members(over):
    expect(P.MalformedFrame, "malformed", raw_frame(header(**over)))


def test_wrong_version_names_both():
    err = expect(P.VersionMismatch, "version", raw_frame(header(v=2, type="future")))
    assert err.got == 2 and "2" in str(err) and str(P.PROTOCOL_VERSION) in str(err)


def test_unknown_type():
    expect(P.UnknownType, "unknown_type", raw_frame(header(type="bye")))


def entry(name="x", dtype="int32", shape=(2,), offset=0, nbytes=8) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes}


@pytest.mark.parametrize("table, payload", [
    ([entry(dtype="float64", nbytes=16)], bytes(16)),                   # dtype not allowed
    ([entry(dtype="object")], bytes(8)),
    ([entry(nbytes=12)], bytes(12)),                                    # shape * itemsize != nbytes
    ([entry(shape=(-2,))], bytes(8)),
    ([entry(shape=(1.5,))], bytes(8)),
    ([entry(offset=-8)], bytes(8)),
    ([entry("a"), entry("b", offset=4)], bytes(16)),                    # overlap
    ([entry("a"), entry("b", offset=12)], bytes(20)),                   # gap
    ([entry(offset=100)], bytes(8)),                                    # out of range
    ([entry()], bytes(12)),                                             # trailing bytes
    ([entry("a"), entry("a", offset=8)], bytes(16)),                    # duplicate name
    (["x"], b""),
    ([{"dtype": "int32", "shape": [0], "offset": 0, "nbytes": 0}], b""),
])
def test_tensor_table_mismatch(table, payload):
    expect(P.TensorMismatch, "tensor_mismatch", raw_frame(header(tensors=table), payload))


def test_hand_built_table_with_empty_tensor_decodes():
    table = [entry("e", shape=(0, 3), nbytes=0, offset=8), entry("x"), entry("z", "uint8", (0,), 0, 0)]
    msg = P.decode(raw_frame(header(tensors=table), np.array([5, 6], "<i4").tobytes()))
    assert msg.tensors["x"].tolist() == [5, 6] and msg.tensors["e"].shape == (0, 3)


# ---- schema -------------------------------------------------------------------------------------------------
def test_schema_covers_every_type():
    assert set(P.SCHEMA) == set(P.MESSAGE_TYPES)
    assert not set(P.CLIENT_TYPES) & set(P.SERVER_TYPES)


def good_verify() -> P.Message:
    n = 3
    return P.decode(P.encode(P.VERIFY, {"session_id": "s", "seq": 1, "temperature": 0, "top_p": 1.0, "top_k": 0},
                             {"tokens": np.arange(n, dtype=np.int32), "parents": np.array([-1, 0, 0], np.int32),
                              "draft_probs": np.ones(n, np.float16)}))


def test_validate_accepts_good_messages():
    P.validate(good_verify())
    P.validate(P.decode(P.error_frame("busy", "try later", seq=3, retry=True)))
    P.validate(P.decode(P.encode(P.PREFILL, {"seq": 0, "session_id": None}, {"tokens": np.zeros(2, np.int32)})))
    rows = P.encode_rows(np.ones((2, 8), np.float32), "int8")
    P.validate(P.decode(P.encode(P.RESUMED, {"accepted_upto": 2, "next_token": 5, "length": 9}, rows)))


def test_validate_names_what_is_missing_or_wrong():
    msg = good_verify()
    del msg.fields["seq"], msg.tensors["parents"]
    msg.fields["top_k"] = True
    msg.tensors["tokens"] = np.zeros(3, np.int64)
    with pytest.raises(P.BadRequest) as info:
        P.validate(msg)
    text = str(info.value)
    assert info.value.code == "bad_request"
    assert all(s in text for s in ("'seq'", "'parents'", "'top_k'", "'tokens'"))
    assert "'session_id'" not in text


@pytest.mark.parametrize("fields", [{"fingerprint": "f", "client": "c", "row_dtype": "bf16"},
                                    {"fingerprint": "f", "client": "c"}])
def test_validate_enums(fields):
    with pytest.raises(P.BadRequest, match="row_dtype"):
        P.validate(P.Message(P.HELLO, fields))


def test_error_frame():
    msg = P.decode(P.error_frame(P.E_LIMIT, "tree too big"))
    assert msg.type == P.ERROR and msg.fields == {"code": "limit", "message": "tree too big", "retry": False}
    with pytest.raises(ValueError):
        P.error_frame("oops", "x")


def test_fingerprint_diff():
    assert P.fingerprint_diff("target=a;memory=b", "target=a;memory=b") == []
    assert P.fingerprint_diff("target=a;memory=b", "memory=c;target=a") == ["memory"]
    assert P.fingerprint_diff("target=a", "target=a;memory=b") == ["memory"]
    assert P.fingerprint_diff("abc", "abd") == ["fingerprint"]


# ---- memory rows --------------------------------------------------------------------------------------------
def test_rows_round_trip_within_bounds():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((6, 64)).astype(np.float32) * np.array([0, 1e-3, 1, 10, 300, 1], np.float32)[:, None]
    rows[5, 3] = 1e6  # beyond fp16 range: clipped, not inf
    fp16 = P.encode_rows(rows, "fp16")
    assert set(fp16) == {"rows"} and fp16["rows"].dtype == np.float16
    back = P.decode_rows(P.decode(P.encode(P.VERIFIED, {}, fp16)).tensors)
    assert np.isfinite(back).all()
    ok = np.ones_like(rows, bool)
    ok[5, 3] = False
    np.testing.assert_allclose(back[ok], rows[ok], rtol=2 ** -11, atol=2 ** -24)

    i8 = P.encode_rows(rows, "int8")
    assert i8["rows"].dtype == np.int8 and i8["row_scale"].dtype == np.float32 and i8["row_scale"].shape == (6,)
    back = P.decode_rows(P.decode(P.encode(P.VERIFIED, {}, i8)).tensors)
    bound = np.abs(rows).max(axis=1, keepdims=True) / 254 * (1 + 1e-5)
    assert (np.abs(back - rows) <= bound).all()
    assert (back[0] == 0).all() and np.abs(i8["rows"]).max() <= 127


def row_bytes(row_width: int, dtype: str) -> int:
    """Payload bytes per token of memory rows (docs/protocol.md): R*2 in fp16, R+4 in int8 (the float32 scale)."""
    return row_width * 2 if dtype == "fp16" else row_width + 4


def test_rows_bytes_per_token_and_errors():
    rows = np.ones((5, 96), np.float32)
    for dtype in P.ROW_DTYPES:
        payload = sum(a.nbytes for a in P.encode_rows(rows, dtype).values())
        assert payload == 5 * row_bytes(96, dtype)
    assert P.decode_rows(P.encode_rows(np.zeros((0, 4)), "int8")).shape == (0, 4)
    with pytest.raises(ValueError):
        P.encode_rows(rows, "bf16")
    with pytest.raises(ValueError):
        P.encode_rows(rows[0])
    with pytest.raises(P.TensorMismatch):
        P.decode_rows({"rows": np.zeros((2, 3), np.int8)})
    with pytest.raises(P.TensorMismatch):
        P.decode_rows({"rows": np.zeros((2, 3), np.float32)})


# ---- docs and dependencies ----------------------------------------------------------------------------------
def test_docs_mention_every_type_field_and_error_code():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    names = {*P.MESSAGE_TYPES, *P.ERROR_CODES}
    for spec in P.SCHEMA.values():
        names |= {k.rstrip("?") for k in (*spec["fields"], *spec["tensors"])}
    assert not {n for n in names if f"`{n}`" not in doc and f"`{n}?`" not in doc}


def test_protocol_needs_only_numpy():
    out = run_blocked("""
before = set(sys.modules)
import moa_core.protocol as P
P.decode(P.encode(P.PING, {"t": 1.0}))
new = {m.split(".")[0] for m in set(sys.modules) - before}
assert not new - set(sys.stdlib_module_names) - {"numpy", "moa_core"}, new
print("ok")
""")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
