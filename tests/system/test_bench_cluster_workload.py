"""The workload of ``kvpool bench cluster``: seeded, shaped as the public benchmarks make
theirs, and kept exactly by its replay file."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.common.keys import shared_salt, tenant_id
from kvpool.tools.bench.cluster.workload import (
    END_ID,
    FIRST_ID,
    FORMAT,
    NOISY,
    PRESETS,
    Request,
    Workload,
    WorkloadParams,
    generate,
    poisson_offsets,
    read_replay,
    write_replay,
)

SEED = 7
BLOCK = 16
"""The tokens of a KV block: prompts that must share nothing differ in their first block."""
TINY_REQUESTS = 7
"""The tiny preset's quiet requests: 2 groups of 2 prompts, and 1 conversation of 3 turns."""
TINY_FLOOD = 3
PD = sorted(name for name, params in PRESETS.items() if params.long_prompts)
"""The presets for prefill/decode disaggregation: long and decode-heavy prompts only."""
SHAPED = sorted(set(PRESETS) - set(PD))


@pytest.fixture(scope="module", params=SHAPED)
def workload(request: pytest.FixtureRequest) -> Workload:
    return generate(PRESETS[request.param], SEED)


@pytest.fixture(scope="module", params=PD)
def pd_workload(request: pytest.FixtureRequest) -> Workload:
    return generate(PRESETS[request.param], SEED)


def _by(requests: tuple[Request, ...], key: Callable[[Request], Any]) -> dict[Any, list[Request]]:
    grouped: dict[Any, list[Request]] = defaultdict(list)
    for request in requests:
        grouped[key(request)].append(request)
    return grouped


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    for params in PRESETS.values():
        first, again, other = generate(params, SEED), generate(params, SEED), generate(params, 8)
        assert first == again and first.digest() == again.digest()
        assert len(first.digest()) == 64
        assert other.digest() != first.digest()
        assert {r.prompt for r in other.requests}.isdisjoint(r.prompt for r in first.requests)
        assert {t.salt for t in other.tenants}.isdisjoint(t.salt for t in first.tenants)


def test_the_digest_covers_each_field_and_every_token() -> None:
    workload = generate(PRESETS["tiny"], SEED)
    last = workload.requests[-1]
    changes: list[dict[str, Any]] = [
        {"prompt": (*last.prompt[:-1], last.prompt[-1] + 1)},
        {"salt": "other"},
        {"offset": last.offset + 0.001},
        {"parent": -1},
        {"max_tokens": 5},
    ]
    for changed in changes:
        requests = (*workload.requests[:-1], dataclasses.replace(last, **changed))
        assert dataclasses.replace(workload, requests=requests).digest() != workload.digest()


def test_the_presets_have_their_sizes() -> None:
    tiny = generate(PRESETS["tiny"], SEED)
    assert len(tiny.requests) == TINY_REQUESTS and len(tiny.flood) == TINY_FLOOD
    assert Counter(r.kind for r in tiny.requests) == {"group": 4, "turn": 3}
    default = [len(generate(PRESETS["default"], seed).requests) for seed in range(5)]
    quick = [len(generate(PRESETS["quick"], seed).requests) for seed in range(5)]
    assert all(80 <= n <= 120 for n in default), default  # 48 group prompts + 36-60 turns
    assert 0.4 < sum(quick) / sum(default) < 0.6


def test_tenants_and_the_shared_space_have_the_seeds_salts(workload: Workload) -> None:
    params = workload.params
    names = [f"tenant-{i}" for i in range(params.quiet_tenants)]
    assert [t.name for t in workload.tenants] == [*names, NOISY]
    assert [t.quiet for t in workload.tenants] == [True] * params.quiet_tenants + [False]
    for tenant in workload.tenants:
        assert tenant.salt == f"bench-{SEED}-{tenant.name}" and tenant.id == tenant_id(tenant.salt)
    assert workload.space_salt == f"bench-{SEED}-space"
    assert workload.space_id == tenant_id(workload.space_salt)
    assert workload.space_members == tuple(names[: params.space_members])
    assert workload.tenant(NOISY) is workload.tenants[-1]
    with pytest.raises(KeyError, match="tenant-0"):
        workload.tenant("nobody")


def test_a_groups_prompts_share_its_system_prompt_and_no_other(workload: Workload) -> None:
    params = workload.params
    groups = _by(tuple(r for r in workload.requests if r.kind == "group"), lambda r: r.group)
    assert sorted(groups) == list(range(params.groups))
    systems = []
    for prompts in groups.values():
        assert len(prompts) == params.group_prompts
        assert all(len(r.prompt) == params.system_tokens + params.question_tokens for r in prompts)
        assert len({r.prompt[: params.system_tokens] for r in prompts}) == 1
        assert len({r.prompt[params.system_tokens :] for r in prompts}) == params.group_prompts
        systems.append(prompts[0].prompt[:BLOCK])
    assert len(set(systems)) == params.groups


def test_the_space_groups_alternate_between_members_with_the_shared_salt(
    workload: Workload,
) -> None:
    params, members = workload.params, workload.space_members
    sent: Counter[str] = Counter()
    for request in workload.requests:
        salt = workload.tenant(request.tenant).salt
        group = -1 if request.group is None else request.group
        if 0 <= group < params.space_groups:
            assert request.tenant in members
            assert request.salt == shared_salt(workload.space_salt, params.system_tokens, salt)
            sent[request.tenant] += 1
        else:  # non-members never carry a shared salt, nor members outside the space's groups
            assert request.salt == salt
        if group >= params.space_groups:
            assert request.tenant == f"tenant-{group % params.quiet_tenants}"
    assert sum(sent.values()) == params.space_groups * params.group_prompts
    assert set(sent) == set(members) and max(sent.values()) - min(sent.values()) <= 1


def test_a_conversation_grows_by_an_answer_and_a_user_message_a_turn(workload: Workload) -> None:
    params = workload.params
    turns = tuple(r for r in workload.requests if r.kind == "turn")
    conversations = _by(turns, lambda r: r.conversation)
    assert sorted(conversations) == list(range(params.conversations))
    common: dict[str, tuple[int, ...]] = {}
    for number, chain in conversations.items():
        assert [r.turn for r in chain] == list(range(1, len(chain) + 1))
        assert len(chain) <= params.turns[1]
        assert {r.tenant for r in chain} == {f"tenant-{number % params.quiet_tenants}"}
        first = chain[0]
        assert first.parent is None
        prefix = first.prompt[: params.common_prefix_tokens]
        assert common.setdefault(first.tenant, prefix) == prefix  # one prefix per tenant
        own = len(first.prompt) - params.common_prefix_tokens
        assert 1 + params.user_tokens[0] <= own <= params.context_max + params.user_tokens[1]
        for before, after in itertools.pairwise(chain):
            assert after.parent == before.id and after.prompt[: len(before.prompt)] == before.prompt
            added = len(after.prompt) - len(before.prompt)
            assert params.answer_tokens[0] + params.user_tokens[0] <= added
            assert added <= params.answer_tokens[1] + params.user_tokens[1]
        if len(chain) < params.turns[0]:  # stopped early: the next turn would be too long
            least = params.answer_tokens[0] + params.user_tokens[0]
            assert len(chain[-1].prompt) + least > params.max_prompt_tokens
    assert len(set(common.values())) == len(common)


def test_a_conversation_stops_before_a_prompt_longer_than_the_limit() -> None:
    tiny = PRESETS["tiny"]  # turn 1: at most 128 + 256 + 64; each turn adds 32 + 64
    longer: dict[str, Any] = {
        "conversations": 4,
        "turns": (12, 12),
        "max_prompt_tokens": 800,
        "flood_tokens": 512,
    }
    params = dataclasses.replace(tiny, **longer)
    turns = tuple(r for r in generate(params, SEED).requests if r.kind == "turn")
    for chain in _by(turns, lambda r: r.conversation).values():
        assert 1 < len(chain) < 12
        assert len(chain[-1].prompt) <= 800 < len(chain[-1].prompt) + 32 + 64


def test_a_conversations_own_context_is_lognormal_around_its_average() -> None:
    many: dict[str, Any] = {"conversations": 1500, "turns": (1, 1), "groups": 2}
    params = dataclasses.replace(PRESETS["default"], **many)
    contexts = [r.segments[1].length for r in generate(params, SEED).requests if r.turn == 1]
    assert len(contexts) == 1500 and max(contexts) == params.context_max  # some were capped
    assert statistics.mean(contexts) == pytest.approx(params.context_tokens, rel=0.05)
    assert statistics.median(contexts) < 0.9 * params.context_tokens  # skewed, as lognormals are


def test_the_flood_is_the_noisy_tenants_unique_long_prompts(workload: Workload) -> None:
    params, noisy = workload.params, workload.tenant(NOISY)
    assert len(workload.flood) == params.flood_prompts
    assert [r.id for r in workload.flood] == list(range(params.flood_prompts))
    for request in workload.flood:
        assert (request.tenant, request.kind, request.salt) == (NOISY, "flood", noisy.salt)
        assert len(request.prompt) == params.flood_tokens and request.parent is None
    firsts = {r.prompt[:BLOCK] for r in workload.flood}
    assert len(firsts) == params.flood_prompts
    assert firsts.isdisjoint(r.prompt[:BLOCK] for r in workload.requests)
    _assert_arrivals(workload.flood)


def test_every_prompt_fits_the_model_and_the_limit(workload: Workload) -> None:
    params = workload.params
    for request in (*workload.requests, *workload.flood):
        assert 0 < len(request.prompt) <= params.max_prompt_tokens
        assert all(FIRST_ID <= token < END_ID for token in request.prompt)
        assert request.max_tokens == params.output_tokens


def _assert_arrivals(requests: tuple[Request, ...]) -> None:
    offsets = [r.offset for r in requests]
    assert [r.id for r in requests] == list(range(len(requests)))
    assert all(0 < a < b for a, b in itertools.pairwise(offsets))
    assert math.isclose(offsets[-1], len(requests), rel_tol=1e-9)  # n / rate at 1 req/s


def test_the_requests_arrive_in_id_order_and_a_turn_after_its_parent(workload: Workload) -> None:
    _assert_arrivals(workload.requests)
    for request in workload.requests:
        if request.parent is not None:
            parent = workload.requests[request.parent]
            assert parent.id < request.id
            assert parent.conversation == request.conversation
            assert (parent.turn or 0) + 1 == request.turn
        else:
            assert request.turn in (None, 1)


def test_group_prompts_come_shuffled() -> None:
    requests = generate(PRESETS["default"], SEED).requests
    groups = [r.group for r in requests if r.kind == "group"]
    changes = sum(a != b for a, b in itertools.pairwise(groups))
    assert changes > 0.7 * len(groups)  # in group order, there would be 7 in 48


def test_turns_mostly_leave_room_for_their_parent_to_finish() -> None:
    gaps = [
        r.id - r.parent
        for seed in range(10)
        for r in generate(PRESETS["default"], seed).requests
        if r.parent is not None
    ]
    assert sum(gap >= 3 for gap in gaps) >= 0.9 * len(gaps)


def test_poisson_offsets_are_vllms_rescaled_gamma_intervals() -> None:
    for burstiness, spread in [(1.0, 1.0), (4.0, 0.5)]:  # a gamma's std / mean: 1 / sqrt(shape)
        offsets = poisson_offsets(10_000, burstiness, random.Random(1))
        intervals = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
        assert math.isclose(offsets[-1], 10_000, rel_tol=1e-9)
        assert statistics.mean(intervals) == pytest.approx(1.0, rel=0.03)
        assert statistics.stdev(intervals) == pytest.approx(spread, rel=0.05)
        assert offsets == poisson_offsets(10_000, burstiness, random.Random(1))
    assert poisson_offsets(0, 1.0, random.Random(1)) == []


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_replay_file_keeps_the_workload_exactly(preset: str, tmp_path: Path) -> None:
    workload = generate(PRESETS[preset], SEED)
    path = tmp_path / "workload.jsonl"
    write_replay(workload, path)
    assert read_replay(path) == workload
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == FORMAT and header["digest"] == workload.digest()
    assert len(lines) == 1 + len(workload.requests) + len(workload.flood)
    tokens = sum(len(r.prompt) for r in (*workload.requests, *workload.flood))
    assert path.stat().st_size < min(2048 + 400 * len(lines), 4 * tokens)  # segments, not ids


def _edit_line(path: Path, number: int, edit: Callable[[dict[str, Any]], object]) -> None:
    lines = path.read_text().splitlines()
    fields = json.loads(lines[number - 1])
    edit(fields)
    lines[number - 1] = json.dumps(fields)
    path.write_text("\n".join(lines) + "\n")


CHANGED = "does not match its check"
TURN_LINE = 2 + next(r.id for r in generate(PRESETS["tiny"], SEED).requests if r.turn == 2)
"""The line of the tiny workload's second turn (a line per request after the header)."""


@pytest.mark.parametrize(
    ("number", "edit", "problem"),
    [
        (TURN_LINE, lambda f: f["segments"][0].update(len=f["segments"][0]["len"] - 1), CHANGED),
        (TURN_LINE, lambda f: f["segments"][1].update(seg="user-0-3"), CHANGED),
        (TURN_LINE, lambda f: f.update(salt="bench-7-tenant-9"), CHANGED),
        (TURN_LINE, lambda f: f.update(offset=f["offset"] + 0.5), CHANGED),
        (TURN_LINE, lambda f: f.update(parent=TURN_LINE), "parent"),
        (TURN_LINE, lambda f: f["segments"][1].update(len=10**9), "len 1000000000 is out of"),
        (TURN_LINE, lambda f: f.pop("salt"), "no field 'salt'"),
        (1, lambda f: f.update(digest="0" * 64), "digest mismatch"),
        (1, lambda f: f.update(format=FORMAT + 1), f"unknown format {FORMAT + 1}"),
        (1, lambda f: f["params"].update(groups=0), "space_groups"),
    ],
)
def test_a_changed_replay_file_fails_in_one_line_naming_the_line(
    tmp_path: Path, number: int, edit: Callable[[dict[str, Any]], object], problem: str
) -> None:
    path = tmp_path / "workload.jsonl"
    write_replay(generate(PRESETS["tiny"], SEED), path)
    _edit_line(path, number, edit)
    with pytest.raises(ValueError) as raised:
        read_replay(path)
    message = str(raised.value)
    assert message.startswith(f"{path} line {number}: ") and problem in message
    assert "\n" not in message


def test_a_missing_line_is_found_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "workload.jsonl"
    write_replay(generate(PRESETS["tiny"], SEED), path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    last = TINY_REQUESTS + TINY_FLOOD
    with pytest.raises(ValueError) as raised:
        read_replay(path)
    assert str(raised.value) == (
        f"{path} line {last}: the header counts {TINY_REQUESTS} requests and {TINY_FLOOD} "
        f"flood requests, the file has {last - 1} lines after it"
    )


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "workload.jsonl"
    write_replay(generate(PRESETS["tiny"], SEED), path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:3], "{not json", *lines[4:]]) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 4: not JSON \("):
        read_replay(path)
    path.write_text("")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 1: no field 'format'$"):
        read_replay(path)


@pytest.mark.parametrize(
    "wrong",
    [
        {"space_groups": 9},
        {"space_members": 5},
        {"turns": (4, 3)},
        {"context_max": 4096},  # a first turn could exceed max_prompt_tokens
        {"flood_tokens": 5000},
        {"long_prompts": 1, "long_tokens": 5000},
        {"decode_prompts": -1},
        {"decode_output_tokens": 0},
        {"burstiness": 0.0},
    ],
)
def test_parameters_that_cannot_make_a_workload_are_refused(wrong: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"^workload parameters: "):
        WorkloadParams(**wrong)


def test_the_pd_presets_have_their_sizes() -> None:
    assert PD == ["pd", "tiny-pd"]
    for name, longs, decodes in [("pd", 12, 24), ("tiny-pd", 2, 4)]:
        requests = generate(PRESETS[name], SEED).requests
        assert Counter(r.kind for r in requests) == {"long": longs, "decode": decodes}, name


def test_pd_prompts_are_unique_long_or_decode_heavy_and_mixed(pd_workload: Workload) -> None:
    params, requests = pd_workload.params, pd_workload.requests
    assert pd_workload.flood == ()
    shapes = {
        "long": (params.long_tokens, params.long_output_tokens),
        "decode": (params.decode_tokens, params.decode_output_tokens),
    }
    for request in requests:
        assert (len(request.prompt), request.max_tokens) == shapes[request.kind]
        assert request.parent is None and request.group is None
        assert request.salt == pd_workload.tenant(request.tenant).salt
        assert all(FIRST_ID <= token < END_ID for token in request.prompt)
    assert len({r.prompt[:BLOCK] for r in requests}) == len(requests)  # nothing is cached
    for kind in shapes:  # each kind's prompts go to the tenants in turn
        tenants = Counter(r.tenant for r in requests if r.kind == kind)
        assert max(tenants.values()) - min(tenants.values()) <= 1
    kinds = [r.kind for r in requests]  # long prompts arrive among the decode-heavy ones
    assert sum(a != b for a, b in itertools.pairwise(kinds)) >= len(kinds) // 4
    _assert_arrivals(requests)


def test_a_pd_replay_line_with_another_output_length_fails_its_check(tmp_path: Path) -> None:
    load = generate(PRESETS["tiny-pd"], SEED)
    path = tmp_path / "workload.jsonl"
    write_replay(load, path)
    number = 2 + next(r.id for r in load.requests if r.kind == "long")
    _edit_line(path, number, lambda f: f.update(max_tokens=f["max_tokens"] - 1))
    with pytest.raises(ValueError, match=f"line {number}: .*does not match its check"):
        read_replay(path)
