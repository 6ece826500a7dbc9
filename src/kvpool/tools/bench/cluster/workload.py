"""The workload of ``kvpool bench cluster``: seeded tenants, prompts and arrivals, and the
replay file that keeps them.

Its shapes follow the public benchmarks:

- **groups** of prompts that share a long system prompt, each with a question of its own, as
  llm-d's inference-perf ``shared_prefix`` and vLLM's ``prefix_repetition`` make them. The
  first ``space_groups`` groups belong to a shared space: its members send their prompts in
  turn, with the structured salt of :func:`kvpool.common.keys.shared_salt`;
- **turns** of conversations, as vLLM's multi-turn benchmark makes them: turn 1 is the
  tenant's common prefix + the conversation's own context + a user message, and each later
  turn is the previous turn's prompt + an answer + a new user message;
- a **flood** of long unique prompts from the tenant ``noisy``, for the isolation phase only;
- for prefill/decode disaggregation (the ``pd`` presets), **long** unique prompts with long
  outputs among a steady stream of **decode**-heavy ones (a short unique prompt, a long
  output): the long prompts' prefills land on servers busy decoding, the interference that
  disaggregation removes. Nothing in them is shared, so each prefill is all the work.

The answers in a conversation's history are placeholder ids drawn from the seed, not the
server's answers: every configuration then sends identical prompts, and a replay file is
complete without a server. Token ids come from blake2b over (seed, segment name, counter), the
same in every Python version; lengths, order and intervals come from :class:`random.Random`
streams seeded by name. Arrivals are Poisson, drawn as vLLM's ``get_request`` draws them
(:func:`poisson_offsets`), at 1 request per second; the bench divides the offsets by its rate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import random
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.common.keys import shared_salt, tenant_id

FORMAT = 1
"""The replay file's format version (:func:`write_replay`)."""
FIRST_ID = 3
END_ID = 2000
"""Token ids are drawn in ``[FIRST_ID, END_ID)``: inside the tests' vocabulary of 2048."""
NOISY = "noisy"
"""The name of the tenant that sends the flood."""
_CONTEXT_SIGMA = 0.5
"""The sigma of the lognormal length of a conversation's own context."""
_GAP_SLOTS = 3
"""A turn comes at least this many slots after its parent while group prompts are left."""
_CHECK_CHARS = 16
"""Hex characters of a request's fingerprint kept on its line of a replay file."""


@dataclass(frozen=True)
class WorkloadParams:
    """How many requests of each kind, and how long their parts are (in tokens)."""

    quiet_tenants: int = 4
    space_members: int = 2
    """The first ``space_members`` quiet tenants share one shared space."""
    groups: int = 8
    """Groups of prompts that share a system prompt."""
    group_prompts: int = 6
    space_groups: int = 2
    """The first ``space_groups`` groups belong to the shared space."""
    system_tokens: int = 1536
    question_tokens: int = 256
    conversations: int = 12
    turns: tuple[int, int] = (3, 5)
    """User turns per conversation, uniform, bounds included."""
    common_prefix_tokens: int = 256
    """A prefix per tenant at the start of each of its conversations."""
    context_tokens: int = 768
    """The lognormal average of a conversation's own context, in its first turn."""
    context_max: int = 2048
    user_tokens: tuple[int, int] = (96, 160)
    answer_tokens: tuple[int, int] = (48, 96)
    """Placeholder answers put in a conversation's history (seeded, not the server's)."""
    output_tokens: int = 16
    max_prompt_tokens: int = 4096
    """A conversation stops when its next prompt would be longer."""
    flood_prompts: int = 24
    flood_tokens: int = 3584
    long_prompts: int = 0
    """Long unique prompts among the quiet tenants' requests (kind ``long``)."""
    long_tokens: int = 3072
    long_output_tokens: int = 128
    decode_prompts: int = 0
    """Short unique prompts with long outputs among them (kind ``decode``)."""
    decode_tokens: int = 64
    decode_output_tokens: int = 256
    burstiness: float = 1.0
    """The gamma shape of the arrival intervals (1: Poisson)."""
    think_s: float = 0.2
    """For the driver: a turn is sent at max(its offset, its parent's end + ``think_s``)."""

    def __post_init__(self) -> None:
        first_turn = self.common_prefix_tokens + self.context_max + self.user_tokens[1]
        sent = [(self.long_prompts, self.long_tokens), (self.decode_prompts, self.decode_tokens)]
        single = max((length for count, length in sent if count > 0), default=0)
        for wrong, problem in [
            (self.quiet_tenants < 1, "quiet_tenants must be 1 or more"),
            (not 0 <= self.space_members <= self.quiet_tenants, "space_members > quiet_tenants"),
            (not 0 <= self.space_groups <= self.groups, "space_groups must be 0 to groups"),
            (self.space_groups > 0 and self.space_members == 0, "space_groups need members"),
            (min(self.system_tokens, self.context_tokens, self.context_max) < 1, "empty part"),
            (not 1 <= self.turns[0] <= self.turns[1], f"turns {self.turns} is no range"),
            (not 1 <= self.user_tokens[0] <= self.user_tokens[1], "user_tokens is no range"),
            (not 0 <= self.answer_tokens[0] <= self.answer_tokens[1], "answer_tokens: no range"),
            (first_turn > self.max_prompt_tokens, "a first turn may exceed max_prompt_tokens"),
            (self.system_tokens + self.question_tokens > self.max_prompt_tokens, "long groups"),
            (self.flood_tokens > self.max_prompt_tokens, "flood_tokens > max_prompt_tokens"),
            (single > self.max_prompt_tokens, "long or decode_tokens > max_prompt_tokens"),
            (min(self.long_prompts, self.decode_prompts) < 0, "a negative count of prompts"),
            (min(self.long_tokens, self.decode_tokens) < 1, "empty part"),
            (min(self.long_output_tokens, self.decode_output_tokens) < 1, "no output"),
            (self.burstiness <= 0, "burstiness must be positive"),
        ]:
            if wrong:
                raise ValueError(f"workload parameters: {problem}")


PRESETS: dict[str, WorkloadParams] = {
    "default": WorkloadParams(),
    "quick": WorkloadParams(groups=4, space_groups=1, conversations=6, flood_prompts=12),
    "tiny": WorkloadParams(
        quiet_tenants=2, space_members=2, groups=2, group_prompts=2, space_groups=1,
        system_tokens=512, question_tokens=64, conversations=1, turns=(3, 3),
        common_prefix_tokens=128, context_tokens=256, context_max=256, user_tokens=(64, 64),
        answer_tokens=(32, 32), output_tokens=4, max_prompt_tokens=2048, flood_prompts=3,
        flood_tokens=1024,
    ),
    "pd": WorkloadParams(
        space_members=0, groups=0, space_groups=0, conversations=0, flood_prompts=0,
        long_prompts=12, long_tokens=3072, long_output_tokens=128, decode_prompts=24,
        decode_tokens=64, decode_output_tokens=256,
    ),
    "tiny-pd": WorkloadParams(
        quiet_tenants=2, space_members=0, groups=0, space_groups=0, conversations=0,
        flood_prompts=0, long_prompts=2, long_tokens=1024, long_output_tokens=16,
        decode_prompts=4, decode_tokens=64, decode_output_tokens=32,
    ),
}  # fmt: skip
"""``default`` (about 100 requests), ``quick`` (about half) and ``tiny`` (for CI); ``pd``
(36 requests: 12 long prompts among 24 decode-heavy ones) and ``tiny-pd`` (for CI), for
prefill/decode disaggregation."""


@dataclass(frozen=True)
class Tenant:
    """A tenant of the bench: its requests carry its salt."""

    name: str
    """``tenant-0``, ``tenant-1``, ... or :data:`NOISY`."""
    salt: str
    quiet: bool

    @property
    def id(self) -> str:
        return tenant_id(self.salt)


@dataclass(frozen=True)
class Segment:
    """A run of token ids: the first ``length`` of the stream that (seed, ``name``) draws."""

    name: str
    length: int


@dataclass(frozen=True)
class Request:
    """One completion request: what it sends, when, and after which other one."""

    id: int
    """Its position in :attr:`Workload.requests`, or in :attr:`Workload.flood`."""
    tenant: str
    kind: str
    """``group``, ``turn``, ``flood``, ``long`` or ``decode``."""
    salt: str
    """The ``cache_salt`` to send: the tenant's, or the shared salt of a space's group."""
    prompt: tuple[int, ...]
    max_tokens: int
    offset: float
    """Its arrival at 1 request per second, in seconds from the start."""
    parent: int | None
    """The previous turn of its conversation, which must finish first."""
    group: int | None = None
    conversation: int | None = None
    turn: int | None = None
    segments: tuple[Segment, ...] = ()
    """What the prompt adds to its parent's prompt (all of it without a parent)."""


@dataclass(frozen=True)
class Workload:
    """Every request of a bench run, the same for the same parameters and seed."""

    seed: int
    params: WorkloadParams
    tenants: tuple[Tenant, ...]
    """The quiet tenants, then :data:`NOISY`."""
    space_salt: str
    space_members: tuple[str, ...]
    requests: tuple[Request, ...]
    """The quiet tenants' requests, in arrival order."""
    flood: tuple[Request, ...]
    """The noisy tenant's requests, with arrivals of their own."""

    @property
    def space_id(self) -> str:
        return tenant_id(self.space_salt)

    def digest(self) -> str:
        """SHA-256 over every request's fields, expanded prompt and offset (in microseconds)."""
        return _digest(_fingerprints(self))

    def tenant(self, name: str) -> Tenant:
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(f"no tenant {name!r}; the tenants are {[t.name for t in self.tenants]}")


def poisson_offsets(count: int, burstiness: float, rng: random.Random) -> list[float]:
    """Arrival offsets of ``count`` requests at 1 request per second, as vLLM's
    ``get_request`` draws them: gamma intervals of shape ``burstiness`` and scale
    1 / ``burstiness``, summed, then scaled so that the last is ``count`` seconds."""
    intervals = (rng.gammavariate(burstiness, 1 / burstiness) for _ in range(count))
    offsets = list(itertools.accumulate(intervals))
    if not offsets or offsets[-1] == 0:
        return offsets
    return [offset * count / offsets[-1] for offset in offsets]


class _Ids:
    """The token ids of one seed's segments, each stream drawn once."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._drawn: dict[str, list[int]] = {}

    def __call__(self, segments: Iterable[Segment]) -> tuple[int, ...]:
        return tuple(itertools.chain.from_iterable(self._draw(s) for s in segments))

    def _draw(self, segment: Segment) -> list[int]:
        ids, span = self._drawn.setdefault(segment.name, []), END_ID - FIRST_ID
        while len(ids) < segment.length:  # 32 ids of 16 bits from each 64-byte hash
            counter = f"{self._seed}/{segment.name}/{len(ids) // 32}".encode()
            block = hashlib.blake2b(counter, digest_size=64).digest()
            ids += [
                FIRST_ID + int.from_bytes(block[i : i + 2], "little") % span
                for i in range(0, 64, 2)
            ]
        return ids[: segment.length]


def generate(params: WorkloadParams, seed: int) -> Workload:
    """The workload of ``params`` and ``seed``: the same for the same two, everywhere."""
    ids = _Ids(seed)
    quiet = [_tenant(seed, f"tenant-{i}", quiet=True) for i in range(params.quiet_tenants)]
    noisy = _tenant(seed, NOISY, quiet=False)
    space_salt, members = f"bench-{seed}-space", quiet[: params.space_members]
    groups = _groups(params, quiet, members, space_salt, ids) + _singles(params, quiet, ids)
    rng = random.Random(f"{seed}-order")
    rng.shuffle(groups)
    conversations = _conversations(params, quiet, ids, random.Random(f"{seed}-conversations"))
    order = _interleave(groups, conversations, rng)
    offsets = poisson_offsets(len(order), params.burstiness, random.Random(f"{seed}-arrivals"))
    latest: dict[int, int] = {}  # conversation -> the id of its latest turn placed
    requests = []
    for position, (request, offset) in enumerate(zip(order, offsets, strict=True)):
        conversation = request.conversation
        parent = None if conversation is None else latest.get(conversation)
        requests.append(dataclasses.replace(request, id=position, offset=offset, parent=parent))
        if conversation is not None:
            latest[conversation] = position
    flood, rng = [], random.Random(f"{seed}-flood")
    arrivals = poisson_offsets(params.flood_prompts, params.burstiness, rng)
    for position, offset in enumerate(arrivals):
        segments = (Segment(f"flood-{position}", params.flood_tokens),)
        flood.append(
            Request(position, noisy.name, "flood", noisy.salt, ids(segments),
                    params.output_tokens, offset, None, segments=segments)
        )  # fmt: skip
    names = tuple(t.name for t in members)
    return Workload(seed, params, (*quiet, noisy), space_salt, names, tuple(requests), tuple(flood))


def _tenant(seed: int, name: str, *, quiet: bool) -> Tenant:
    return Tenant(name, f"bench-{seed}-{name}", quiet)


def _groups(
    params: WorkloadParams,
    quiet: Sequence[Tenant],
    members: Sequence[Tenant],
    space_salt: str,
    ids: _Ids,
) -> list[Request]:
    """Each group's prompts, not yet placed (ids and offsets to come): the space's groups
    sent by its members in turn, with the shared salt; the others by one tenant each."""
    groups = []
    for group, number in itertools.product(range(params.groups), range(params.group_prompts)):
        shared = group < params.space_groups
        tenant = members[number % len(members)] if shared else quiet[group % len(quiet)]
        salt = shared_salt(space_salt, params.system_tokens, tenant.salt) if shared else tenant.salt
        segments = (
            Segment(f"system-{group}", params.system_tokens),
            Segment(f"question-{group}-{number}", params.question_tokens),
        )
        groups.append(
            Request(-1, tenant.name, "group", salt, ids(segments), params.output_tokens, 0.0,
                    None, group=group, segments=segments)
        )  # fmt: skip
    return groups


def _singles(params: WorkloadParams, quiet: Sequence[Tenant], ids: _Ids) -> list[Request]:
    """The long and the decode-heavy prompts, not yet placed: each unique, its tenant's in
    turn. They are shuffled with the group prompts, so they arrive mixed."""
    kinds = [
        ("long", params.long_prompts, params.long_tokens, params.long_output_tokens),
        ("decode", params.decode_prompts, params.decode_tokens, params.decode_output_tokens),
    ]
    singles = []
    for kind, count, length, output in kinds:
        for number in range(count):
            tenant = quiet[number % len(quiet)]
            segments = (Segment(f"{kind}-{number}", length),)
            singles.append(
                Request(-1, tenant.name, kind, tenant.salt, ids(segments), output, 0.0, None,
                        segments=segments)
            )  # fmt: skip
    return singles


def _conversations(
    params: WorkloadParams, quiet: Sequence[Tenant], ids: _Ids, rng: random.Random
) -> list[list[Request]]:
    """Each conversation's turns, in order, not yet placed (ids and offsets to come): it
    stops before a prompt longer than ``max_prompt_tokens``."""
    mu = math.log(params.context_tokens) - _CONTEXT_SIGMA**2 / 2  # its mean is context_tokens
    conversations = []
    for conversation in range(params.conversations):
        tenant = quiet[conversation % len(quiet)]
        turns = rng.randint(*params.turns)
        context = min(params.context_max, max(1, round(rng.lognormvariate(mu, _CONTEXT_SIGMA))))
        segments: tuple[Segment, ...] = (
            Segment(f"common-{tenant.name}", params.common_prefix_tokens),
            Segment(f"context-{conversation}", context),
            Segment(f"user-{conversation}-1", rng.randint(*params.user_tokens)),
        )
        prompt: tuple[int, ...] = ()
        chain: list[Request] = []
        for turn in range(1, turns + 1):
            if turn > 1:
                segments = (
                    Segment(
                        f"answer-{conversation}-{turn - 1}", rng.randint(*params.answer_tokens)
                    ),
                    Segment(f"user-{conversation}-{turn}", rng.randint(*params.user_tokens)),
                )
            if len(prompt) + sum(s.length for s in segments) > params.max_prompt_tokens:
                break
            prompt += ids(segments)
            chain.append(
                Request(-1, tenant.name, "turn", tenant.salt, prompt, params.output_tokens, 0.0,
                        None, conversation=conversation, turn=turn, segments=segments)
            )  # fmt: skip
        conversations.append(chain)
    return conversations


def _interleave(
    groups: Sequence[Request], conversations: Sequence[Sequence[Request]], rng: random.Random
) -> list[Request]:
    """The group prompts in their order, with the conversations' turns put among them.

    A slot takes a turn with the odds of the turns left against the prompts left, from a
    conversation (picked at random) whose latest turn is at least :data:`_GAP_SLOTS` slots
    back. Once the group prompts run out, the turns left follow; when no conversation is that
    far back, the one that has waited longest goes next."""
    waiting = [list(reversed(chain)) for chain in conversations]
    latest = [-_GAP_SLOTS] * len(waiting)
    order: list[Request] = []
    placed_groups, turns_left = 0, sum(map(len, conversations))
    while placed_groups < len(groups) or turns_left:
        slot, groups_left = len(order), len(groups) - placed_groups
        ready = [i for i, chain in enumerate(waiting) if chain and slot - latest[i] >= _GAP_SLOTS]
        if (ready and rng.random() * (turns_left + groups_left) < turns_left) or not groups_left:
            pending = [i for i, chain in enumerate(waiting) if chain]
            conversation = rng.choice(ready) if ready else min(pending, key=latest.__getitem__)
            order.append(waiting[conversation].pop())
            latest[conversation], turns_left = slot, turns_left - 1
        else:
            order.append(groups[placed_groups])
            placed_groups += 1
    return order


def _fingerprint(section: str, r: Request) -> bytes:
    """SHA-256 over what a request sends and when: it names the request in the digest."""
    fields = [section, r.id, r.tenant, r.kind, r.salt, r.max_tokens, r.parent, r.group]
    fields += [r.conversation, r.turn, f"{r.offset:.6f}"]
    hashed = hashlib.sha256(json.dumps(fields).encode())
    hashed.update(struct.pack(f"<{len(r.prompt)}I", *r.prompt))
    return hashed.digest()


def _fingerprints(workload: Workload) -> list[bytes]:
    sections = {"requests": workload.requests, "flood": workload.flood}
    return [_fingerprint(name, r) for name, requests in sections.items() for r in requests]


def _digest(fingerprints: Iterable[bytes]) -> str:
    hashed = hashlib.sha256(f"kvpool bench cluster workload, format {FORMAT}".encode())
    for fingerprint in fingerprints:
        hashed.update(fingerprint)
    return hashed.hexdigest()


def write_replay(workload: Workload, path: Path) -> None:
    """Write ``workload`` as JSON Lines: a header, then a line per request (the quiet ones,
    then the flood) with the segments its prompt adds to its parent's, and a check (the
    start of its fingerprint) that names the line a change was made on."""
    fingerprints = _fingerprints(workload)
    header = {
        "format": FORMAT, "seed": workload.seed, "params": dataclasses.asdict(workload.params),
        "tenants": [{"name": t.name, "salt": t.salt, "quiet": t.quiet} for t in workload.tenants],
        "space_salt": workload.space_salt, "space_members": list(workload.space_members),
        "digest": _digest(fingerprints),
        "requests": len(workload.requests), "flood": len(workload.flood),
    }  # fmt: skip
    lines: list[dict[str, Any]] = [header]
    for r, fingerprint in zip((*workload.requests, *workload.flood), fingerprints, strict=True):
        line = {"id": r.id, "tenant": r.tenant, "kind": r.kind, "salt": r.salt}
        line |= {"max_tokens": r.max_tokens, "offset": r.offset, "parent": r.parent}
        where = {"group": r.group, "conversation": r.conversation, "turn": r.turn}
        line |= {key: value for key, value in where.items() if value is not None}
        line["segments"] = [{"seg": s.name, "len": s.length} for s in r.segments]
        line["check"] = fingerprint.hex()[:_CHECK_CHARS]
        lines.append(line)
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))


def read_replay(path: Path) -> Workload:
    """The workload in a file :func:`write_replay` wrote, its format, every line's check and
    the digest verified. Any problem is a ValueError of one line that names the file and the
    line, and the field or the value."""
    texts, number = path.read_text().splitlines(), 1
    try:
        header = json.loads(texts[0]) if texts else {}
        if header["format"] != FORMAT:
            version = header["format"]
            raise ValueError(f"unknown format {version!r} (this kvpool reads format {FORMAT})")
        params = WorkloadParams(**_tuples(header["params"]))
        counts = {"requests": header["requests"], "flood": header["flood"]}
        if len(texts) != 1 + sum(counts.values()):
            number = len(texts)
            raise ValueError(
                f"the header counts {counts['requests']} requests and {counts['flood']} flood "
                f"requests, the file has {len(texts) - 1} lines after it"
            )
        ids, fingerprints = _Ids(header["seed"]), []
        sections: dict[str, list[Request]] = {"requests": [], "flood": []}
        for number, text in enumerate(texts[1:], start=2):
            section = "requests" if number - 2 < counts["requests"] else "flood"
            line = json.loads(text)
            request = _request(line, params, ids, sections[section])
            fingerprints.append(_fingerprint(section, request))
            if fingerprints[-1].hex()[:_CHECK_CHARS] != line["check"]:
                raise ValueError(
                    f"request {request.id} of the {section} does not match its check "
                    f"{line['check']!r}: a field or a segment was changed"
                )
            sections[section].append(request)
        number = 1
        if header["digest"] != (found := _digest(fingerprints)):
            raise ValueError(
                f"digest mismatch: the header says {header['digest']!r}, "
                f"the requests hash to {found}"
            )
        tenants = tuple(Tenant(t["name"], t["salt"], t["quiet"]) for t in header["tenants"])
        members = tuple(header["space_members"])
        requests, flood = tuple(sections["requests"]), tuple(sections["flood"])
        return Workload(
            header["seed"], params, tenants, header["space_salt"], members, requests, flood
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {number}: not JSON ({e})") from None
    except KeyError as e:
        raise ValueError(f"{path} line {number}: no field {e}") from None
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(f"{path} line {number}: {e}") from None


def _tuples(values: dict[str, Any]) -> dict[str, Any]:
    """JSON's lists as tuples: the parameters as :class:`WorkloadParams` has them."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def _request(
    line: dict[str, Any], params: WorkloadParams, ids: _Ids, earlier: Sequence[Request]
) -> Request:
    """The request on a line of a replay file, its prompt expanded (after its parent's, one
    of ``earlier``)."""
    if line["id"] != len(earlier):
        raise ValueError(f"id {line['id']!r} is out of order, expected {len(earlier)}")
    if (parent := line["parent"]) is not None and not 0 <= parent < len(earlier):
        raise ValueError(f"parent {parent!r} is not an earlier request")
    segments = tuple(Segment(s["seg"], s["len"]) for s in line["segments"])
    for s in segments:
        if not 0 <= s.length <= params.max_prompt_tokens:
            raise ValueError(
                f"segment {s.name!r}: len {s.length!r} is out of 0..{params.max_prompt_tokens}"
            )
    prompt = (earlier[parent].prompt if parent is not None else ()) + ids(segments)
    return Request(
        line["id"], line["tenant"], line["kind"], line["salt"], prompt, line["max_tokens"],
        line["offset"], parent, line.get("group"), line.get("conversation"), line.get("turn"),
        segments,
    )  # fmt: skip
