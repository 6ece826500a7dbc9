"""The fingerprint check: the index hashes gateways' prompts as this engine's connector does.

The connector's keys are seeded by a :class:`~kvpool.common.keys.ModelFingerprint` (model,
dtype, KV layout, tensor-parallel rank and size, chunk size; it logs it at start as "key
fingerprint for the index"). The pool's index hashes a gateway's token ids with the
fingerprint configured in ``spec.index.fingerprint`` (rendered into the index's
ConfigMap). Where they differ in any field, every route query misses. Skipped without a
model, without a pool, and for a pool without an index or without a default fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from kvpool.common.index_config import Fingerprint
from kvpool.common.keys import ModelFingerprint
from kvpool.common.names import index_config_map_name
from kvpool.tools.doctor.kube import KubeReader, refusal
from kvpool.tools.doctor.report import Check, failed, passed, skipped

NAME = "fingerprint"


@dataclass(frozen=True)
class EngineModel:
    """What the command line says about the engine (the fields the connector logs)."""

    model: str | None
    dtype: str | None
    kv_layout: str | None
    tp_size: int


def check_fingerprint(
    engine: EngineModel,
    chunk_tokens: int | None,
    kube: KubeReader | None,
    pool: str | None,
    namespace: str | None,
) -> Check:
    missing = [
        option
        for option, value in (
            ("--model", engine.model),
            ("--dtype", engine.dtype),
            ("--kv-layout", engine.kv_layout),
        )
        if value is None
    ]
    if missing:
        return skipped(NAME, f"no {', '.join(missing)} given (the connector logs them at start)")
    if kube is None or pool is None or namespace is None:
        return skipped(NAME, "no pool: the index's fingerprint is read from the pool's ConfigMap")
    if chunk_tokens is None:
        return skipped(NAME, "the pool's Service does not advertise its chunk size")
    where = f"{namespace}/{index_config_map_name(pool)}"
    try:
        config = kube.index_config(pool, namespace)
    except Exception as error:  # the Kubernetes client raises many kinds
        why = refusal(error)
        if why.status == 404:
            return skipped(NAME, f"the pool has no index (no ConfigMap {where})")
        return skipped(
            NAME,
            f"cannot read the index's ConfigMap {where} (the connector does not need it): "
            f"{why.message}",
        )
    if not isinstance(config, dict) or config.get("fingerprint") is None:
        return skipped(
            NAME,
            "the index has no default fingerprint: gateways send one with each query "
            "(what the connector logs)",
        )
    try:
        configured = Fingerprint.model_validate(config["fingerprint"]).fingerprint()
    except ValidationError as error:
        return failed(NAME, f"the index's fingerprint in {where} does not parse: {error}", _SET)
    assert engine.model is not None and engine.dtype is not None and engine.kv_layout is not None
    connector = ModelFingerprint(
        engine.model,
        engine.dtype,
        engine.kv_layout,
        # the index matches one rank's keys; the engine makes every rank's
        configured.tp_rank if configured.tp_rank < engine.tp_size else 0,
        engine.tp_size,
        chunk_tokens,
    )
    ours, theirs = dataclasses.asdict(connector), dataclasses.asdict(configured)
    differ = [field for field in ours if ours[field] != theirs[field]]
    if differ:
        seen = "; ".join(
            f"{field}: index {theirs[field]!r}, connector {ours[field]!r}" for field in differ
        )
        patch = {"spec": {"index": {"fingerprint": {to_camel(k): v for k, v in ours.items()}}}}
        return failed(
            NAME,
            f"the index ({where}) hashes prompts for another engine: {seen}",
            f"kubectl -n {namespace} patch kvp {pool} --type=merge -p '{json.dumps(patch)}'",
        )
    return passed(NAME, f"the index hashes prompts as this engine's connector: {json.dumps(ours)}")


_SET = "set spec.index.fingerprint of the KVCachePool to what the connector logs"
