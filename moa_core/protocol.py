"""Wire codec for the edge <-> verify-server protocol (spec: docs/protocol.md).

Imports only the standard library and numpy: the edge client must never pull in torch.

A frame is one binary websocket message:
    b"MOA1" | uint32 LE header length | UTF-8 JSON header | little-endian tensor payloads
The header is {"type", "v", "fields", "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}]},
offsets relative to the payload start; the table covers the payload exactly.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Union

import numpy as np

from moa_core.tree import DraftTree, check_sources

MAGIC = b"MOA1"
PROTOCOL_VERSION = 1
DTYPES = ("int32", "int64", "float16", "float32", "int8", "uint8")
ROW_DTYPES = ("fp16", "int8")
_PREFIX = struct.Struct("<4sI")
_ALIGN = 8  # the payload starts 8-aligned in the frame and tensors go largest itemsize first
MAX_NDIM = 8  # tensor dimensions a frame may declare (the protocol's tensors have 1 or 2)
INT_RANGE = (-(1 << 63), 1 << 63)  # header integers must fit in int64
MIN_TEMPERATURE = 1e-3  # sampling temperatures are 0 (greedy) or at least this (smaller ones overflow the softmax)

# Message types, client -> server.
HELLO, PREFILL, VERIFY, RESUME = "hello", "prefill", "verify", "resume"
GENERATE, CLOSE, PING = "generate", "close", "ping"
CLIENT_TYPES = (HELLO, PREFILL, VERIFY, RESUME, GENERATE, CLOSE, PING)
# Message types, server -> client.
WELCOME, PREFILLED, VERIFIED, RESUMED = "welcome", "prefilled", "verified", "resumed"
TOKEN, DONE, ERROR, PONG = "token", "done", "error", "pong"
SERVER_TYPES = (WELCOME, PREFILLED, VERIFIED, RESUMED, TOKEN, DONE, ERROR, PONG)
MESSAGE_TYPES = CLIENT_TYPES + SERVER_TYPES

# Error codes (the "code" field of an error message, and ProtocolError.code).
E_MALFORMED = "malformed"
E_VERSION = "version"
E_FINGERPRINT = "fingerprint"
E_UNKNOWN_TYPE = "unknown_type"
E_BAD_REQUEST = "bad_request"
E_OUT_OF_VOCAB = "out_of_vocab"
E_BAD_TREE = "bad_tree"
E_LIMIT = "limit"
E_TENSOR_MISMATCH = "tensor_mismatch"
E_UNKNOWN_SESSION = "unknown_session"
E_FOREIGN_SESSION = "foreign_session"
E_AUTH = "auth"
E_INTERNAL = "internal"
E_BUSY = "busy"
ERROR_CODES = (E_MALFORMED, E_VERSION, E_FINGERPRINT, E_UNKNOWN_TYPE, E_BAD_REQUEST, E_OUT_OF_VOCAB, E_BAD_TREE,
               E_LIMIT, E_TENSOR_MISMATCH, E_UNKNOWN_SESSION, E_FOREIGN_SESSION, E_AUTH, E_INTERNAL, E_BUSY)


class ProtocolError(Exception):
    """A protocol violation; `code` is the error code to send back in an `error` message."""

    code: str = E_INTERNAL

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class MalformedFrame(ProtocolError):
    """Bad magic, truncated frame, header not a JSON object."""

    code = E_MALFORMED


class VersionMismatch(ProtocolError):
    """The frame's protocol version differs from PROTOCOL_VERSION; `got` is the peer's version."""

    code = E_VERSION

    def __init__(self, got: int) -> None:
        super().__init__(f"protocol version {got} is not supported: this side speaks version {PROTOCOL_VERSION}")
        self.got = got


class TensorMismatch(ProtocolError):
    """The tensor table disagrees with the payload (dtype, shape, offset, nbytes)."""

    code = E_TENSOR_MISMATCH


class UnknownType(ProtocolError):
    """The message type is not one of MESSAGE_TYPES."""

    code = E_UNKNOWN_TYPE


class BadRequest(ProtocolError):
    """A message lacks required fields/tensors or has them with the wrong type (see `validate`)."""

    code = E_BAD_REQUEST


@dataclass
class Message:
    """A decoded frame. Tensors are read-only little-endian views into the frame."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    v: int = PROTOCOL_VERSION


# ---- schema -----------------------------------------------------------------------------------------------
# A field kind is a name in _KINDS or a tuple of allowed strings; a tensor spec is (dtypes, allowed ndims).
# A trailing "?" marks an optional field/tensor (it may be absent or null).
FieldKind = Union[str, tuple[str, ...]]
TensorSpec = tuple[tuple[str, ...], tuple[int, ...]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KINDS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "number": lambda v: _is_int(v) or isinstance(v, float),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "int[]": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
}

_TOKENS: dict[str, TensorSpec] = {"tokens": (("int32",), (1,))}
_ROWS: dict[str, TensorSpec] = {"rows": (("float16", "int8"), (2,)), "row_scale?": (("float32",), (1,))}
_SAMPLING: dict[str, FieldKind] = {"temperature": "number", "top_p": "number", "top_k": "int"}
_SAMPLING_OPT: dict[str, FieldKind] = {f"{k}?": v for k, v in _SAMPLING.items()}
_TREE: dict[str, TensorSpec] = {**_TOKENS, "parents": (("int32",), (1,)), "q_ids?": (("int32",), (2,)),
                                "q_probs?": (("float16", "float32"), (2,)), "sources?": (("uint8",), (1,))}

SCHEMA: dict[str, dict[str, dict[str, Any]]] = {
    HELLO: {"fields": {"fingerprint": "str", "client": "str", "row_dtype": ROW_DTYPES, "auth?": "str"},
            "tensors": {}},
    WELCOME: {"fields": {"session_id": "str", "limits": "object", "target": "str", "fingerprint": "str",
                         "vocab_size": "int", "row_width": "int", "row_dtype": ROW_DTYPES, "costs?": "object"},
              "tensors": {}},
    PREFILL: {"fields": {"session_id?": "str", "seq": "int", **_SAMPLING_OPT}, "tensors": _TOKENS},
    PREFILLED: {"fields": {"seq": "int", "next_token": "int", "length": "int", "timings?": "object"},
                "tensors": _ROWS},
    VERIFY: {"fields": {"session_id": "str", "seq": "int", **_SAMPLING}, "tensors": _TREE},
    VERIFIED: {"fields": {"seq": "int", "accepted": "int[]", "next_token": "int", "length": "int",
                          "timings?": "object"},
               "tensors": _ROWS},
    RESUME: {"fields": {"session_id": "str", "length": "int", "policy": ("keep", "verify"), **_SAMPLING_OPT},
             "tensors": _TOKENS},
    RESUMED: {"fields": {"accepted_upto": "int", "next_token": "int", "length": "int", "timings?": "object"},
              "tensors": _ROWS},
    GENERATE: {"fields": {"session_id?": "str", "max_new_tokens": "int", **_SAMPLING, "drafter": ("none", "server"),
                          "seed?": "int", "copy_tokens?": "int"},
               "tensors": _TOKENS},
    TOKEN: {"fields": {"text": "str", "tokens?": "int[]"}, "tensors": {}},
    DONE: {"fields": {"tokens": "int[]", "text": "str", "finish_reason": ("eos", "stop", "length"), "stats": "object"},
           "tensors": {}},
    CLOSE: {"fields": {"session_id?": "str"}, "tensors": {}},
    PING: {"fields": {"t?": "number"}, "tensors": {}},
    PONG: {"fields": {"t?": "number"}, "tensors": {}},
    ERROR: {"fields": {"code": ERROR_CODES, "message": "str", "seq?": "int", "retry": "bool"}, "tensors": {}},
}


def _kind_ok(value: Any, kind: FieldKind) -> bool:
    return isinstance(value, str) and value in kind if isinstance(kind, tuple) else _KINDS[kind](value)


def validate(msg: Message) -> None:
    """Check `msg` against SCHEMA; raise BadRequest naming every missing or ill-typed field/tensor."""
    if msg.type not in SCHEMA:
        raise UnknownType(f"unknown message type {msg.type!r}")
    spec = SCHEMA[msg.type]
    missing: list[str] = []
    invalid: list[str] = []
    for key, kind in spec["fields"].items():
        name = key.rstrip("?")
        value = msg.fields.get(name)
        if value is None:
            if not key.endswith("?"):
                missing.append(f"field {name!r}")
        elif not _kind_ok(value, kind):
            invalid.append(f"field {name!r} (expected {'|'.join(kind) if isinstance(kind, tuple) else kind})")
    for key, (dtypes, ndims) in spec["tensors"].items():
        name = key.rstrip("?")
        arr = msg.tensors.get(name)
        if arr is None:
            if not key.endswith("?"):
                missing.append(f"tensor {name!r}")
        elif arr.dtype.name not in dtypes or arr.ndim not in ndims:
            invalid.append(f"tensor {name!r} (got {arr.dtype.name}{list(arr.shape)}, expected "
                           f"{'|'.join(dtypes)} with ndim {'|'.join(map(str, ndims))})")
    if missing or invalid:
        parts = [f"{label} {', '.join(items)}" for label, items in (("missing", missing), ("invalid", invalid))
                 if items]
        raise BadRequest(f"{msg.type}: {'; '.join(parts)}")


# ---- frames -----------------------------------------------------------------------------------------------
class _Entry(NamedTuple):
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in the header")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of the float64 range")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not INT_RANGE[0] <= value < INT_RANGE[1]:
        raise ValueError(f"integer {text[:40]} is out of the int64 range")
    return value


def encode(msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """Build one frame. Field values must be JSON-serialisable (numpy scalars are converted)."""
    if msg_type not in MESSAGE_TYPES:
        raise UnknownType(f"unknown message type {msg_type!r}")
    arrays: list[tuple[str, np.ndarray]] = []
    for name, arr in (tensors or {}).items():
        arr = np.asarray(arr)
        if arr.dtype.name not in DTYPES:
            raise TensorMismatch(f"tensor {name!r}: dtype {arr.dtype} is not one of {', '.join(DTYPES)}")
        arrays.append((name, arr.astype(arr.dtype.newbyteorder("<"), copy=False)))
    arrays.sort(key=lambda item: -item[1].itemsize)  # keeps every tensor aligned to its itemsize
    table, offset = [], 0
    for name, arr in arrays:
        table.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape), "offset": offset,
                      "nbytes": arr.nbytes})
        offset += arr.nbytes
    header = json.dumps({"type": msg_type, "v": PROTOCOL_VERSION, "fields": fields or {}, "tensors": table},
                        separators=(",", ":"), allow_nan=False, default=_json_default).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
    return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *(arr.tobytes() for _, arr in arrays)])


def _entry(raw: Any) -> _Entry:
    """Check one tensor-table entry and its internal consistency."""
    if not isinstance(raw, dict):
        raise TensorMismatch(f"tensor table entry is not an object: {str(raw)[:80]}")
    name, dtype, shape, offset, nbytes = (raw.get(k) for k in ("name", "dtype", "shape", "offset", "nbytes"))
    if not isinstance(name, str):
        raise TensorMismatch(f"tensor table entry without a string name: {str(raw)[:80]}")
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise TensorMismatch(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d) and d >= 0 for d in shape)):
        raise TensorMismatch(f"tensor {name!r}: bad shape {str(shape)[:80]} (at most {MAX_NDIM} dimensions >= 0)")
    if not (_is_int(offset) and offset >= 0 and _is_int(nbytes) and nbytes >= 0):
        raise TensorMismatch(f"tensor {name!r}: bad offset/nbytes {offset!r}/{nbytes!r}")
    dt = np.dtype(dtype).newbyteorder("<")
    if math.prod(shape) * dt.itemsize != nbytes:
        raise TensorMismatch(f"tensor {name!r}: shape {shape} of {dtype} needs {math.prod(shape) * dt.itemsize} "
                             f"bytes, table says {nbytes}")
    return _Entry(name, dt, tuple(shape), offset, nbytes)


def _read_tensors(table: list[Any], payload: memoryview) -> dict[str, np.ndarray]:
    """Check that `table` tiles `payload` exactly (no gap, overlap or overrun) and return read-only views."""
    entries = [_entry(raw) for raw in table]
    if len({e.name for e in entries}) != len(entries):
        raise TensorMismatch("duplicate tensor names")
    end = 0
    for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if e.offset != end:
            raise TensorMismatch(f"tensor {e.name!r} at offset {e.offset}, expected {end} "
                                 "(gap, overlap or out of range)")
        end += e.nbytes
    if end > len(payload):
        raise MalformedFrame(f"truncated payload: the tensor table needs {end} bytes, the frame has {len(payload)}")
    if end < len(payload):
        raise TensorMismatch(f"{len(payload) - end} trailing payload bytes not in the tensor table")
    tensors = {}
    for e in entries:
        arr = np.frombuffer(payload[e.offset:e.offset + e.nbytes], dtype=e.dtype).reshape(e.shape)
        arr.flags.writeable = False
        tensors[e.name] = arr
    return tensors


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse one frame; raise MalformedFrame, VersionMismatch, UnknownType or TensorMismatch."""
    if isinstance(frame, str):
        raise MalformedFrame("text frame: the protocol uses binary frames")
    buf = memoryview(frame).cast("B")
    if len(buf) < _PREFIX.size:
        raise MalformedFrame(f"truncated frame: {len(buf)} bytes")
    magic, header_len = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise MalformedFrame(f"bad magic {bytes(magic)!r}")
    start = _PREFIX.size + header_len
    if start > len(buf):
        raise MalformedFrame(f"truncated header: {header_len} bytes announced, {len(buf) - _PREFIX.size} present")
    try:
        header = json.loads(bytes(buf[_PREFIX.size:start]).decode("utf-8"), parse_constant=_reject_constant,
                            parse_float=_finite_float, parse_int=_int64)
    except ValueError as exc:  # includes JSONDecodeError and UnicodeDecodeError
        raise MalformedFrame(f"bad header JSON: {exc}") from None
    except RecursionError:
        raise MalformedFrame("bad header JSON: nested too deeply") from None
    if not isinstance(header, dict):
        raise MalformedFrame("header is not a JSON object")
    v = header.get("v")
    if not _is_int(v):
        raise MalformedFrame("header has no integer 'v'")
    if v != PROTOCOL_VERSION:
        raise VersionMismatch(v)
    msg_type = header.get("type")
    if not isinstance(msg_type, str):
        raise MalformedFrame("header has no string 'type'")
    if msg_type not in MESSAGE_TYPES:
        raise UnknownType(f"unknown message type {msg_type!r}")
    fields, table = header.get("fields", {}), header.get("tensors", [])
    if not isinstance(fields, dict) or not isinstance(table, list):
        raise MalformedFrame("header 'fields' must be an object and 'tensors' a list")
    return Message(msg_type, fields, _read_tensors(table, buf[start:]), v)


def sampling_problem(temperature: float, top_p: float, top_k: int) -> str | None:
    """Why these sampling settings are invalid, or None: temperature 0 (greedy) or in [MIN_TEMPERATURE, inf),
    top_p in (0, 1], top_k >= 0 (0 = off)."""
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf) or not 0 < top_p <= 1 or top_k < 0:
        return (f"bad sampling settings: temperature {temperature} (0 or >= {MIN_TEMPERATURE:g}), top_p {top_p} "
                f"(in (0, 1]), top_k {top_k} (>= 0)")
    return None


def error_frame(code: str, message: str, seq: int | None = None, retry: bool = False) -> bytes:
    """An `error` frame; `seq` echoes the request's sequence number when known."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    fields: dict[str, Any] = {"code": code, "message": message, "retry": retry}
    if seq is not None:
        fields["seq"] = seq
    return encode(ERROR, fields)


# ---- memory rows ------------------------------------------------------------------------------------------
def encode_rows(rows: np.ndarray, dtype: str = "fp16") -> dict[str, np.ndarray]:
    """float32 [n, R] rows -> {"rows": float16} (clipped to the fp16 range) or {"rows": int8, "row_scale": float32 [n]}.

    int8 uses a symmetric per-row scale max|x|/127 (0 for an all-zero row).
    """
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"rows must be [n, R], got shape {rows.shape}")
    if dtype == "fp16":
        limit = float(np.finfo(np.float16).max)
        return {"rows": np.clip(rows, -limit, limit).astype(np.float16)}
    if dtype == "int8":
        scale = np.abs(rows).max(axis=1, initial=0.0) / np.float32(127)
        q = np.divide(rows, scale[:, None], out=np.zeros_like(rows), where=scale[:, None] > 0)
        return {"rows": np.rint(q).astype(np.int8), "row_scale": scale.astype(np.float32)}
    raise ValueError(f"row dtype must be one of {ROW_DTYPES}, got {dtype!r}")


def decode_rows(tensors: dict[str, np.ndarray]) -> np.ndarray:
    """Inverse of encode_rows: float32 [n, R]."""
    rows = tensors.get("rows")
    if rows is None or rows.ndim != 2:
        raise TensorMismatch("memory rows must be a 2-D 'rows' tensor")
    if rows.dtype == np.float16:
        return rows.astype(np.float32)
    if rows.dtype == np.int8:
        scale = tensors.get("row_scale")
        if scale is None or scale.dtype != np.float32 or scale.shape != rows.shape[:1]:
            raise TensorMismatch(f"int8 rows [{rows.shape[0]}, R] need a float32 'row_scale' [{rows.shape[0]}]")
        return rows.astype(np.float32) * scale[:, None]
    raise TensorMismatch(f"rows dtype {rows.dtype} is not float16 or int8")


# ---- draft trees -------------------------------------------------------------------------------------------
def check_vocab(ids: np.ndarray, vocab_size: int, what: str = "tokens") -> None:
    """Raise ProtocolError(out_of_vocab) unless every id is in [0, vocab_size)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ProtocolError(f"{what}: id {int(ids[bad][0])} is outside the vocabulary [0, {vocab_size})",
                            E_OUT_OF_VOCAB)


def encode_tree(root: int, tree: DraftTree, with_q: bool = False, q_dtype: str = "float32") -> dict[str, np.ndarray]:
    """The `verify` tensors of root + tree: wire index 0 is the root, wire index i+1 is tree node i.

    `with_q` adds the draft distributions (needed when sampling; float32 keeps the rejection sampling exact) and,
    for a tree with a copy chain, which nodes were drawn and which copied (`sources`, the root's entry 0).
    """
    tensors = {"tokens": np.concatenate([[root], tree.tokens]).astype(np.int32),
               "parents": np.concatenate([[-1], np.asarray(tree.parents) + 1]).astype(np.int32)}
    if with_q:
        tensors["q_ids"] = tree.q_ids.astype(np.int32)
        tensors["q_probs"] = tree.q_probs.astype(q_dtype)
        if tree.sources is not None:
            tensors["sources"] = np.concatenate([[0], tree.sources]).astype(np.uint8)
    return tensors


def decode_tree(tensors: dict[str, np.ndarray], vocab_size: int, max_tokens: int,
                need_q: bool) -> tuple[int, DraftTree]:
    """Check the `verify` tensors (validated dtypes) and rebuild (root, DraftTree); inverse of encode_tree.

    Raises ProtocolError: bad_tree (shapes, parents, q, sources), out_of_vocab, limit (more than max_tokens
    tokens).
    """
    tokens, parents = tensors["tokens"].astype(np.int64), tensors["parents"].astype(np.int64)
    n = len(tokens)
    if n == 0 or parents.shape != tokens.shape:
        raise ProtocolError(f"tokens [{n}] and parents {list(parents.shape)} must both be [n+1] with n >= 0",
                            E_BAD_TREE)
    if n > max_tokens:
        raise ProtocolError(f"tree of {n} tokens (root included) is over max_tree_tokens={max_tokens}", E_LIMIT)
    check_vocab(tokens, vocab_size)
    bad = np.flatnonzero((parents[1:] < 0) | (parents[1:] >= np.arange(1, n)))
    if parents[0] != -1 or len(bad):
        where = ("parents[0] must be -1 (the root)" if parents[0] != -1 else
                 f"parents[{bad[0] + 1}] = {parents[bad[0] + 1]} is not in [0, {bad[0] + 1})")
        raise ProtocolError(f"not a tree in topological order: {where}", E_BAD_TREE)
    depths = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    q_ids, q_probs = tensors.get("q_ids"), tensors.get("q_probs")
    if (q_ids is None) != (q_probs is None) or (need_q and q_ids is None):
        raise ProtocolError("sampling needs both q_ids and q_probs [n+1, K]" if need_q else
                            "q_ids and q_probs go together", E_BAD_TREE)
    if q_ids is None:
        q_ids, q_probs = np.zeros((n, 1), np.int64), np.zeros((n, 1), np.float32)
    elif q_ids.shape != q_probs.shape or q_ids.shape[0] != n or q_ids.shape[1] == 0:
        raise ProtocolError(f"q_ids {list(q_ids.shape)} and q_probs {list(q_probs.shape)} must both be [{n}, K], "
                            "K >= 1", E_BAD_TREE)
    else:
        check_vocab(q_ids, vocab_size, "q_ids")
        q_probs = q_probs.astype(np.float32)
        if not np.isfinite(q_probs).all() or (q_probs < 0).any() or (q_probs.sum(1) > 1.01).any():
            raise ProtocolError("q_probs must be finite, >= 0 and sum to at most 1 per row", E_BAD_TREE)
    sources = tensors.get("sources")
    if sources is not None:
        if sources.shape != tokens.shape or sources[0] != 0:
            raise ProtocolError(f"sources {list(sources.shape)} must be [{n}] with 0 for the root", E_BAD_TREE)
        sources = sources[1:]
        try:
            check_sources(parents[1:] - 1, sources)
        except ValueError as e:
            raise ProtocolError(str(e), E_BAD_TREE) from None
    tree = DraftTree(tokens=tokens[1:], parents=parents[1:] - 1, depths=depths[1:], q_ids=q_ids.astype(np.int64),
                     q_probs=q_probs.astype(np.float32), sources=sources)
    return int(tokens[0]), tree


def encode_accepted(path: list[int]) -> list[int]:
    """The `verified` reply's `accepted` field: wire indices (root 0, tree node i at i+1) of root + `path`."""
    return [0] + [i + 1 for i in path]


def decode_accepted(accepted: list[int]) -> list[int]:
    """The accepted tree nodes below the root; inverse of encode_accepted."""
    return [i - 1 for i in accepted[1:]]


# ---- fingerprints -----------------------------------------------------------------------------------------
def fingerprint_diff(ours: str, theirs: str) -> list[str]:
    """Names of the parts that differ between two "name=value;..." fingerprints (["fingerprint"] if not that form)."""
    try:
        a, b = (dict(part.split("=", 1) for part in fp.split(";")) for fp in (ours, theirs))
    except ValueError:
        return [] if ours == theirs else ["fingerprint"]
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
