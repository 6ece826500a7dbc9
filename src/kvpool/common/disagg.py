"""Prefill/decode disaggregation's contracts: kvpool's part of vLLM's ``kv_transfer_params``,
and the prefill header that the endpoint picker signs for the decode pod's sidecar.

**kv_transfer_params.** vLLM hands a request's ``kv_transfer_params`` to the connector and
puts what the connector's ``request_finished`` returns into the response's top-level
``kv_transfer_params``. kvpool's part is the object under :data:`PARAMS_KEY`::

    to the prefill pod (the sidecar sends it):
        {"kvpool": {"v": 1, "role": "prefill", "push_to": "node-b"}}
    from the prefill pod, what the decode pod needs:
        {"kvpool": {"v": 1, "role": "decode", "tokens": 3000, "tail": true}}
    to the decode pod (the sidecar adds where the prefill ran and how long to wait):
        {"kvpool": {"v": 1, "role": "decode", "tokens": 3000, "tail": true,
                    "node": "node-a", "wait_ms": 2000}}

They carry no key, salt or tenant id: the decode pod derives every key from its own request
(its token ids and ``cache_salt``), so no value in them can make it load another tenant's
chunks. What a forged object can change: how long the decode waits (within the decode
engine's own cap) and, on a prefill pod, which pool node it offers the tenant's own
chunks to.

**The prefill header** (:data:`PREFILL_HEADER`): the endpoint picker names the prefill pod
of a request it disaggregates, and the decode pod's sidecar POSTs the prefill there. So
that no client can point a sidecar at an address of its choice, the value is signed with
the pool's disaggregation key (a file both mount): ``address;node;expires;signature``,
the signature an HMAC-SHA256 over the rest (:func:`sign_prefill`, :func:`verify_prefill`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool.common.names import MAX_PD_DECODE_WAIT_MS

PARAMS_KEY = "kvpool"
PARAMS_VERSION = 1
PREFILL_HEADER = "x-kvpool-prefill"
"""The picker's signed choice of a prefill pod (see the module docstring)."""
RESULT_HEADER = "x-kvpool-pd"
"""The sidecar's account of a request: ``prefill=<address>; status=ok|fallback|...``."""
MIN_KEY_BYTES = 32
_SIGNATURE_DOMAIN = b"kvpool-prefill-v1\0"
_ADDRESS = re.compile(r"[A-Za-z0-9._-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")
_NODE = re.compile(r"[A-Za-z0-9._-]{0,253}")
_MAX_TOKENS = 10_000_000


class ParamsError(ValueError):
    """kvpool's ``kv_transfer_params`` are malformed (the message names the field)."""


class HeaderError(ValueError):
    """A prefill header that must not be followed (the message says why, never the key)."""


@dataclass(frozen=True)
class PrefillParams:
    """A prefill of a disaggregated request: store the whole prompt, its last partial chunk
    too, and answer what the decode needs."""

    push_to: str | None = None
    """The node of the decode pod, whose agent the prefill's agent offers the chunks to."""

    def to_json(self) -> dict[str, object]:
        inner: dict[str, object] = {"v": PARAMS_VERSION, "role": "prefill"}
        if self.push_to:
            inner["push_to"] = self.push_to
        return {PARAMS_KEY: inner}


@dataclass(frozen=True)
class DecodeParams:
    """A decode of a request whose prompt another pod prefilled."""

    tokens: int
    """The prompt's length as the prefill keyed it: a decode whose prompt differs ignores
    these params (another tokenization)."""
    tail: bool
    """The prefill stored the tokens after the prompt's last full chunk too."""
    node: str | None = None
    """The node the prefill ran on: where the decode's agent pulls what it lacks."""
    wait_ms: int | None = None
    """How long the decode may wait for the prompt's chunks (the engine caps it)."""

    def to_json(self) -> dict[str, object]:
        inner: dict[str, object] = {
            "v": PARAMS_VERSION,
            "role": "decode",
            "tokens": self.tokens,
            "tail": self.tail,
        }
        if self.node:
            inner["node"] = self.node
        if self.wait_ms is not None:
            inner["wait_ms"] = self.wait_ms
        return {PARAMS_KEY: inner}


def read_params(params: object) -> PrefillParams | DecodeParams | None:
    """kvpool's part of a request's ``kv_transfer_params`` (None: it has none);
    :class:`ParamsError` naming the field when it is malformed."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
    inner = params.get(PARAMS_KEY)
    if inner is None:
        return None
    where = f"kv_transfer_params.{PARAMS_KEY}"
    if not isinstance(inner, Mapping):
        raise ParamsError(f"{where}: expected an object, got {type(inner).__name__}")
    if inner.get("v") != PARAMS_VERSION:
        raise ParamsError(f"{where}.v: expected {PARAMS_VERSION}, got {inner.get('v')!r}")
    role = inner.get("role")
    known = {"v", "role", "push_to"} if role == "prefill" else {"v", "role", "tokens", "tail"}
    if role == "decode":
        known |= {"node", "wait_ms"}
    elif role != "prefill":
        raise ParamsError(f"{where}.role: expected 'prefill' or 'decode', got {role!r}")
    unknown = sorted(str(name) for name in inner if name not in known)
    if unknown:
        raise ParamsError(f"{where}: unknown field {unknown[0]!r} for role {role!r}")
    if role == "prefill":
        return PrefillParams(push_to=_node(inner.get("push_to"), f"{where}.push_to"))
    tail = inner.get("tail")
    if not isinstance(tail, bool):
        raise ParamsError(f"{where}.tail: expected true or false, got {tail!r}")
    wait_ms = inner.get("wait_ms")
    return DecodeParams(
        tokens=_count(inner.get("tokens"), f"{where}.tokens", 1, _MAX_TOKENS),
        tail=tail,
        node=_node(inner.get("node"), f"{where}.node"),
        wait_ms=None
        if wait_ms is None
        else _count(wait_ms, f"{where}.wait_ms", 0, MAX_PD_DECODE_WAIT_MS),
    )


def _count(value: object, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ParamsError(f"{where}: expected an integer from {low} to {high}, got {value!r}")
    return value


def _node(value: object, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or not _NODE.fullmatch(value):
        raise ParamsError(f"{where}: expected a node name, got {value!r}")
    return value


@dataclass(frozen=True)
class PrefillTarget:
    """The prefill pod the picker chose: where the sidecar POSTs the prefill."""

    address: str
    """``host:port`` (``[v6]:port``) of the prefill pod's server."""
    node: str
    """The node it runs on ("" when the picker does not know)."""
    expires: int
    """Unix seconds after which the header is not followed."""


def read_key(path: Path) -> bytes:
    """The pool's disaggregation key from ``path`` (its bytes, surrounding whitespace
    dropped); ValueError naming the file when it is too short to sign with."""
    key = path.read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{path}: a disaggregation key needs at least {MIN_KEY_BYTES} bytes, "
            f"has {len(key)} (make one with: openssl rand -hex 32)"
        )
    return key


def sign_prefill(key: bytes, target: PrefillTarget) -> str:
    """The header value naming ``target``, signed with ``key``."""
    if not _ADDRESS.fullmatch(target.address) or not _NODE.fullmatch(target.node):
        raise ValueError(f"not a prefill target: {target.address!r} on {target.node!r}")
    body = f"{target.address};{target.node};{target.expires}"
    return f"{body};{_signature(key, body)}"


def verify_prefill(key: bytes, value: str, now: float) -> PrefillTarget:
    """The target a header value names, if ``key`` signed it and it has not expired;
    :class:`HeaderError` otherwise."""
    parts = value.strip().split(";")
    if len(parts) != 4:
        raise HeaderError(f"{PREFILL_HEADER}: expected address;node;expires;signature")
    address, node, expires, signature = parts
    if not hmac.compare_digest(_signature(key, ";".join(parts[:3])), signature):
        raise HeaderError(f"{PREFILL_HEADER}: the signature does not match the pool's key")
    if not _ADDRESS.fullmatch(address) or not _NODE.fullmatch(node) or not expires.isdigit():
        raise HeaderError(f"{PREFILL_HEADER}: a signed value that is malformed")
    if int(expires) < now:
        raise HeaderError(f"{PREFILL_HEADER}: expired {now - int(expires):.0f} s ago")
    return PrefillTarget(address, node, int(expires))


def is_address(value: str) -> bool:
    """Whether ``value`` is a prefill pod's ``host:port`` (``[v6]:port``) as a signed header
    may name it: what an unsigned header (llm-d's) is held to as well."""
    return _ADDRESS.fullmatch(value) is not None


def _signature(key: bytes, body: str) -> str:
    return hmac.new(key, _SIGNATURE_DOMAIN + body.encode(), hashlib.sha256).hexdigest()
