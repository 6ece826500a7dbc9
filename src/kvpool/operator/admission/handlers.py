"""The webhook's kopf registrations, made only when the operator is started with it
(:func:`register`): two indices, the admission settings at start, the mutating handler.

The handler reads the indices only, so admission asks the API server nothing: a tenant or
a pool created a moment ago is known once its watch event has arrived.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf

from kvpool.common.names import CACHE_POOL_LABEL
from kvpool.operator.admission.server import Webhook, WebhookOptions
from kvpool.operator.admission.sidecar import DecodeSidecar
from kvpool.operator.admission.wiring import Binding, PoolFacts, apply, wire
from kvpool.operator.reasons import ACCEPTED
from kvpool.operator.reconcile import Options
from kvpool.operator.render import Pool
from kvpool.operator.spec import GROUP, PLURAL, TENANT_PLURAL, VERSION, InvalidSpec, PoolSpec

HANDLER = "cache-pool"
"""The handler's id: its webhook is ``cache-pool.<configuration>``, its path ``/cache-pool``."""

logger = logging.getLogger(__name__)


def register(registry: kopf.OperatorRegistry, options: WebhookOptions) -> None:
    """Serve the webhook (``options``) from the operator of ``registry``."""

    @kopf.on.startup(registry=registry)
    def serve_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.admission.server = Webhook(options)
        settings.admission.managed = options.configuration

    kopf.index(GROUP, VERSION, PLURAL, registry=registry)(pool_facts)
    kopf.index(GROUP, VERSION, TENANT_PLURAL, registry=registry)(tenant_bindings)
    kopf.on.mutate(
        "v1",
        "pods",
        id=HANDLER,
        operations=["CREATE"],
        labels={CACHE_POOL_LABEL: kopf.PRESENT},
        ignore_failures=True,
        side_effects=False,
        persistent=True,
        registry=registry,
    )(wire_pod)


def pool_facts(
    namespace: str | None, name: str, uid: str | None, spec: kopf.Spec, memo: kopf.Memo, **_: Any
) -> dict[tuple[str, str], PoolFacts]:
    """(namespace, name) -> what a pod needs of the pool; an invalid pool is left out."""
    try:
        parsed = PoolSpec.parse(spec)
    except InvalidSpec:
        return {}
    pool = Pool(name, str(namespace), str(uid))
    facts = PoolFacts(
        name,
        str(namespace),
        parsed.ports.zmq,
        parsed.chunk_tokens,
        frozenset(parsed.engine_namespaces),
        DecodeSidecar.of(pool, parsed, Options.of(memo).agent_image),
    )
    return {(str(namespace), name): facts}


def tenant_bindings(
    namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(tenant namespace, pool name) -> (tenant, pool namespace, why the pool refuses it:
    its Accepted condition's reason, or empty), for each tenant."""
    ref = spec.get("poolRef") or {}
    refused = next(
        (
            str(condition.get("reason") or "refused")
            for condition in status.get("conditions") or ()
            if condition.get("type") == ACCEPTED and condition.get("status") == "False"
        ),
        "",
    )
    return {(str(namespace), str(ref.get("name"))): (name, str(ref.get("namespace")), refused)}


def wire_pod(
    body: kopf.Body,
    namespace: str | None,
    patch: kopf.Patch,
    warnings: list[str],
    **kwargs: Any,
) -> None:
    """A labelled pod being created: wire it to its tenant's pool (or warn, and leave it)."""
    tenants: kopf.Index[tuple[str, str], tuple[str, str, str]] = kwargs["tenant_bindings"]
    pools: kopf.Index[tuple[str, str], PoolFacts] = kwargs["pool_facts"]
    value = str(body.metadata.labels.get(CACHE_POOL_LABEL, ""))
    namespace = namespace or ""
    bindings = [
        Binding(
            tenant,
            pool_namespace,
            next(iter(pools.get((pool_namespace, value), ())), None),
            refused,
        )
        for tenant, pool_namespace, refused in tenants.get((namespace, value), ())
    ]
    wiring = wire(body, namespace, bindings)
    warnings.extend(wiring.warnings)
    for warning in wiring.warnings:
        name = body.metadata.name or f"{body.metadata.get('generateName', '')}*"
        logger.warning("pod %s/%s: %s", namespace, name, warning)
    if wiring.patch:
        ops = wiring.patch
        patch.fns.append(lambda pod: apply(ops, cast(dict[str, Any], pod)))
