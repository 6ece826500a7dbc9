"""The P/D sidecar as a process over real sockets: what it sends the prefill pod and the
local vLLM, what the client gets, and what it refuses to follow."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvpool.common.disagg import PREFILL_HEADER, RESULT_HEADER, PrefillTarget, sign_prefill
from kvpool.common.names import MAX_PD_DECODE_WAIT_MS
from tests.sidecar.conftest import (
    DECODE_WAIT_MS,
    KEY,
    MAX_BODY_BYTES,
    NODE,
    PREFILL_TIMEOUT_S,
    Sidecar,
)
from tests.sidecar.fake_vllm import FakeVllm, Reply
from tests.support.polling import wait_until
from tests.support.ports import free_port

pytestmark = pytest.mark.process

PREFILL_NODE = "node-a"
DECODE_PARAMS = {"kvpool": {"v": 1, "role": "decode", "tokens": 3, "tail": True}}
COMPLETION = {
    "model": "m",
    "prompt": "the prompt",
    "max_tokens": 50,
    "stream": False,
    "cache_salt": "alice",
    "min_tokens": 5,
    "stream_options": {"include_usage": True},
}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 50,
    "stream": True,
}


def header(address: str, *, key: bytes = KEY, expires_in: float = 60) -> dict[str, str]:
    target = PrefillTarget(address, PREFILL_NODE, int(time.time() + expires_in))
    return {PREFILL_HEADER: sign_prefill(key, target), "x-request-id": "req-1"}


def prefill_answer(**extra: object) -> Reply:
    """What a prefill pod with kvpool's connector answers a completion."""
    body = {
        "choices": [{"text": "x", "prompt_token_ids": [1, 2, 3]}],
        "kv_transfer_params": DECODE_PARAMS,
        **extra,
    }
    return Reply(body=body)


def post(
    sidecar: Sidecar, body: object, headers: dict[str, str], path: str = "/v1/completions"
) -> httpx.Response:
    return httpx.post(f"{sidecar.url}{path}", json=body, headers=headers, timeout=10)


def test_without_a_header_the_request_passes_through_unchanged(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    raw = json.dumps(COMPLETION).encode()
    answer = httpx.post(
        f"{signed.url}/v1/completions?x=1",
        content=raw,
        headers={"content-type": "application/json", "x-request-id": "r"},
    )
    assert answer.status_code == 200
    assert answer.json() == {"choices": [{"text": "hello"}]}
    assert answer.headers[RESULT_HEADER] == "status=passthrough"
    (received,) = decode.received
    assert received.body == raw
    assert received.headers["x-request-id"] == "r"
    assert not prefill.received


def test_other_paths_and_methods_pass_through(signed: Sidecar, decode: FakeVllm) -> None:
    decode.reply = Reply(body={"metrics": "vllm's"})
    answer = httpx.get(f"{signed.url}/metrics", headers=header("127.0.0.1:9"))
    assert answer.json() == {"metrics": "vllm's"}
    assert RESULT_HEADER not in answer.headers
    (received,) = decode.received
    assert (received.method, received.path) == ("GET", "/metrics")
    assert PREFILL_HEADER not in received.headers


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda address: header(address, key=b"f" * 32)[PREFILL_HEADER], id="forged"),
        pytest.param(lambda address: header(address, expires_in=-5)[PREFILL_HEADER], id="expired"),
        pytest.param(lambda address: f"{address};node-a;9999999999;00", id="unsigned"),
        pytest.param(lambda address: "garbage", id="malformed"),
    ],
)
def test_a_header_that_fails_verification_is_stripped_and_not_followed(
    signed: Sidecar,
    decode: FakeVllm,
    prefill: FakeVllm,
    value: Callable[[str], str],
) -> None:
    answer = post(signed, COMPLETION, {PREFILL_HEADER: value(prefill.address)})
    assert answer.status_code == 200
    assert answer.headers[RESULT_HEADER] == "status=passthrough"
    assert not prefill.received
    (received,) = decode.received
    assert PREFILL_HEADER not in received.headers
    assert received.json() == COMPLETION


def test_a_signed_header_runs_the_prefill_there_then_the_decode_here(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    prefill.reply = prefill_answer()
    answer = post(signed, COMPLETION, header(prefill.address))
    assert answer.status_code == 200
    assert answer.json() == {"choices": [{"text": "hello"}]}
    result = answer.headers[RESULT_HEADER]
    assert result.startswith(f"prefill={prefill.address}; status=ok; prefill_ms=")

    (sent,) = prefill.received
    assert sent.path == "/v1/completions"
    assert sent.headers["x-request-id"] == "req-1"
    assert PREFILL_HEADER not in sent.headers
    assert sent.json() == {
        "model": "m",
        "prompt": "the prompt",
        "max_tokens": 1,
        "stream": False,
        "cache_salt": "alice",
        "return_token_ids": True,
        "kv_transfer_params": {"kvpool": {"v": 1, "role": "prefill", "push_to": NODE}},
    }
    (decoded,) = decode.received
    assert decoded.headers["x-request-id"] == "req-1"
    assert PREFILL_HEADER not in decoded.headers
    # completions: vLLM ignores prompt_token_ids there, so none are sent
    params = {
        "kvpool": {**DECODE_PARAMS["kvpool"], "node": PREFILL_NODE, "wait_ms": DECODE_WAIT_MS}
    }
    assert decoded.json() == {**COMPLETION, "kv_transfer_params": params}


def test_a_chat_decode_streams_with_the_prefills_token_ids_event_by_event(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    prefill.reply = Reply(
        body={
            "choices": [{"message": {"content": "x"}}],
            "prompt_token_ids": [7, 8, 9],
            "kv_transfer_params": DECODE_PARAMS,
        }
    )
    release = threading.Event()
    decode.reply = Reply(events=[b'{"n": 1}', b'{"n": 2}', b"[DONE]"], release=release)
    with httpx.stream(
        "POST",
        f"{signed.url}/v1/chat/completions",
        json=CHAT,
        headers=header(prefill.address),
        timeout=10,
    ) as answer:
        assert answer.headers["content-type"] == "text/event-stream"
        assert "status=ok" in answer.headers[RESULT_HEADER]
        chunks = answer.iter_raw()
        assert next(chunks) == b'data: {"n": 1}\n\n'  # before the rest exists
        release.set()
        assert b"".join(chunks) == b'data: {"n": 2}\n\ndata: [DONE]\n\n'
    (sent,) = prefill.received
    assert sent.json()["max_completion_tokens"] == 1
    assert sent.json()["stream"] is False
    (decoded,) = decode.received
    params = decoded.json()["kv_transfer_params"]
    assert params["prompt_token_ids"] == [7, 8, 9]
    assert params["kvpool"]["node"] == PREFILL_NODE
    assert decoded.json()["stream"] is True


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(Reply(status=500, body={"error": "oom"}), id="5xx"),
        pytest.param(Reply(delay_s=PREFILL_TIMEOUT_S + 2), id="timeout"),
        pytest.param(Reply(body={"choices": []}), id="no-params"),
        pytest.param(None, id="refused"),
    ],
)
def test_a_failed_prefill_falls_back_to_the_original_request_here(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm, failure: Reply | None
) -> None:
    address = prefill.address
    if failure is None:
        address = f"127.0.0.1:{free_port()}"
    else:
        prefill.reply = failure
    started = time.monotonic()
    answer = post(signed, COMPLETION, header(address))
    assert time.monotonic() - started < PREFILL_TIMEOUT_S + 1.5
    assert answer.status_code == 200
    assert f"prefill={address}; status=fallback" in answer.headers[RESULT_HEADER]
    (received,) = decode.received
    assert received.json() == COMPLETION


def test_a_prefill_pods_4xx_is_the_clients_answer(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    prefill.reply = Reply(status=400, body={"error": "prompt too long"})
    answer = post(signed, COMPLETION, header(prefill.address))
    assert answer.status_code == 400
    assert answer.json() == {"error": "prompt too long"}
    assert "status=refused" in answer.headers[RESULT_HEADER]
    assert not decode.received


def test_a_body_that_is_not_json_goes_to_vllm_as_is(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    answer = httpx.post(
        f"{signed.url}/v1/completions", content=b"{not json", headers=header(prefill.address)
    )
    assert answer.status_code == 200
    assert answer.headers[RESULT_HEADER] == f"prefill={prefill.address}; status=passthrough"
    assert not prefill.received
    assert decode.received[0].body == b"{not json"


def test_an_oversized_body_is_refused_unread(signed: Sidecar, decode: FakeVllm) -> None:
    answer = httpx.post(f"{signed.url}/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1))
    assert answer.status_code == 413
    assert "larger than" in answer.json()["detail"]
    assert not decode.received


def test_a_client_that_leaves_a_stream_cancels_the_decode(
    signed: Sidecar, decode: FakeVllm
) -> None:
    decode.reply = Reply(events=[b'{"n": 1}'], hold=True)
    with httpx.stream("POST", f"{signed.url}/v1/completions", json=CHAT, timeout=10) as answer:
        assert next(answer.iter_raw()) == b'data: {"n": 1}\n\n'
    wait_until(decode.disconnected.is_set, timeout=5, what="the decode's cancel")


def test_a_client_that_leaves_during_the_prefill_cancels_it(
    signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    prefill.reply = Reply(hold=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{signed.url}/v1/completions",
            json=COMPLETION,
            headers=header(prefill.address),
            timeout=0.3,
        )
    wait_until(prefill.disconnected.is_set, timeout=5, what="the prefill's cancel")
    time.sleep(0.2)
    assert not decode.received


def test_without_a_key_signed_headers_are_stripped_and_llmds_followed_if_asked(
    keyless: Sidecar, signed: Sidecar, decode: FakeVllm, prefill: FakeVllm
) -> None:
    post(keyless, COMPLETION, header(prefill.address))
    assert not prefill.received
    assert PREFILL_HEADER not in decode.received[0].headers

    llmd = {"x-prefiller-host-port": prefill.address}
    prefill.reply = prefill_answer()
    decode.reset()
    answer = post(signed, COMPLETION, llmd)  # not asked: ignored, stripped
    assert answer.headers[RESULT_HEADER] == "status=passthrough"
    assert "x-prefiller-host-port" not in decode.received[0].headers
    assert not prefill.received

    answer = post(keyless, COMPLETION, llmd)
    assert answer.headers[RESULT_HEADER].startswith(f"prefill={prefill.address}; status=ok")
    decoded = decode.received[-1].json()
    assert "node" not in decoded["kv_transfer_params"]["kvpool"]  # llm-d's names no node


def test_a_start_with_an_unusable_key_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    short = tmp_path / "key"
    short.write_text("short")
    done = _start(f"--key-file={short}")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "needs at least 32 bytes" in done.stderr


def test_a_decode_wait_above_the_connectors_ceiling_is_refused_at_start() -> None:
    """The connector would reject the decode's params as malformed and look up as usual:
    the sidecar refuses the flag instead, in one line naming it."""
    done = _start(f"--decode-wait-ms={MAX_PD_DECODE_WAIT_MS + 1}")
    assert done.returncode == 2
    assert "--decode-wait-ms" in done.stderr.splitlines()[-1]
    assert f"at most {MAX_PD_DECODE_WAIT_MS}" in done.stderr


def _start(*flags: str) -> subprocess.CompletedProcess[str]:
    """The sidecar started with ``flags``, as far as it gets (these refuse to start)."""
    return subprocess.run(
        [sys.executable, "-m", "kvpool.sidecar", *flags],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
