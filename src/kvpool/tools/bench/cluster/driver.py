"""Send a workload's requests to a gateway at their arrival times, and record each answer.

Open loop, as vLLM's ``benchmark_serving`` sends: each request goes at its planned time,
whether or not earlier ones were answered, except a conversation's turn,
which waits for its previous turn's answer and the workload's think time (a user reads the
answer before asking again; a saturated system so slows its conversations, as real users'
are). Each request streams (``stream_options.include_usage``), so the time to its first
token is the client's own; its generated ids and each position's two best candidates are
kept (``return_token_ids``, ``logprobs``) for comparing configurations.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.common.disagg import RESULT_HEADER
from kvpool.tools.bench.cluster.cluster import MODEL
from kvpool.tools.bench.cluster.workload import Request

TOP_LOGPROBS = 2
REQUEST_TIMEOUT_S = 300.0
PROGRESS_S = 5.0


@dataclass
class Answer:
    """One request's outcome, as the client saw it."""

    id: int
    tenant: str
    kind: str
    sent: float
    """Seconds from the segment's start."""
    status: int = 0
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    """Seconds from the send to each generated token's arrival (a chunk's tokens share its
    time): the gaps between them are the inter-token latencies a user sees."""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Each generated position's best candidates: (token id, log-probability)."""
    served_by: str = ""
    pick: str = ""
    disaggregated: str = ""
    """The P/D sidecar's account (``prefill=<address>; status=ok; prefill_ms=<n>``)."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft is not None

    @property
    def itl(self) -> float | None:
        """Inter-token latency: the time after the first token over the tokens after it."""
        if self.ttft is None or self.e2e is None or len(self.tokens) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.tokens) - 1)


def body(request: Request) -> dict[str, Any]:
    """The OpenAI completion request of ``request``: greedy, exactly ``max_tokens``."""
    return {
        "model": MODEL,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_salt": request.salt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # the generated ids (the model has no tokenizer)
        "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True,  # candidates as "token_id:<id>"
    }


async def _send(client: httpx.AsyncClient, url: str, request: Request, answer: Answer) -> None:
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body(request)) as response:
        answer.status = response.status_code
        answer.served_by = response.headers.get("x-served-by", "")
        answer.pick = response.headers.get("x-kvpool-pick", "")
        answer.disaggregated = response.headers.get(RESULT_HEADER, "")
        if response.status_code != 200:
            answer.error = (await response.aread()).decode(errors="replace")[:300]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            _take(json.loads(line[len("data: ") :]), answer, time.perf_counter() - started)
    answer.e2e = time.perf_counter() - started


def _take(chunk: dict[str, Any], answer: Answer, elapsed: float) -> None:
    """One streamed chunk: generated tokens (the first one's time is the TTFT), usage."""
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids") or []
        if ids and answer.ttft is None:
            answer.ttft = elapsed
        answer.tokens.extend(int(token) for token in ids)
        answer.token_times.extend([elapsed] * len(ids))
        for position in (choice.get("logprobs") or {}).get("top_logprobs") or ():
            candidates = sorted(position.items(), key=lambda item: -item[1])
            answer.top.append([(int(name.split(":", 1)[1]), value) for name, value in candidates])
    usage = chunk.get("usage")
    if usage:
        answer.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        answer.cached_tokens = int(details.get("cached_tokens") or 0)


@dataclass(frozen=True)
class Planned:
    """A request and when to send it: seconds from the segment's start."""

    request: Request
    at: float


def planned(requests: Sequence[Request], rate: float) -> list[Planned]:
    """``requests`` at ``rate`` per second (their offsets are at one per second)."""
    return [Planned(request, request.offset / rate) for request in requests]


class Progress:
    """Requests done, in flight and failed, for the bench's progress line."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.done = 0
        self.failed = 0


async def _run(
    url: str, plan: Sequence[Planned], think_s: float, report: Callable[[Progress], None]
) -> list[Answer]:
    finished = {p.request.id: asyncio.Event() for p in plan if p.request.kind != "flood"}
    progress = Progress(len(plan))
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    start = time.perf_counter()

    async def one(client: httpx.AsyncClient, request: Request, at: float) -> Answer:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if request.parent is not None:
            await finished[request.parent].wait()
            await asyncio.sleep(think_s)
        answer = Answer(request.id, request.tenant, request.kind, time.perf_counter() - start)
        progress.sent += 1
        try:
            await _send(client, url, request, answer)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as error:
            answer.error = f"{type(error).__name__}: {error}"[:300]
        finally:
            progress.done += 1
            progress.failed += not answer.ok
            if request.id in finished and request.kind != "flood":
                finished[request.id].set()
        return answer

    async def tell() -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            report(progress)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        teller = asyncio.create_task(tell())
        try:
            answers = await asyncio.gather(*(one(client, p.request, p.at) for p in plan))
        finally:
            teller.cancel()
    return list(answers)


def drive(
    url: str, plan: Sequence[Planned], think_s: float, report: Callable[[Progress], None]
) -> list[Answer]:
    """Send the planned requests to the gateway at ``url``; every answer, in the plan's
    order (``report`` is told the progress every few seconds)."""
    return asyncio.run(_run(url, plan, think_s, report))
