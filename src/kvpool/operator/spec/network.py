"""A pool's NetworkPolicies (``spec.networkPolicy``): who may connect to its pods."""

from __future__ import annotations

from typing import Self

from pydantic import ConfigDict, Field, model_validator

from kvpool.operator.spec.base import SpecModel
from kvpool.operator.spec.markers import ATOMIC, Rule, cel
from kvpool.operator.spec.selectors import LabelSelector

PEER_SELECTS_NOTHING = "a networkPolicy peer sets podSelector, namespaceSelector or both"
NETWORK_POLICY_NEEDS_CLIENTS = (
    "spec.networkPolicy.enabled needs spec.networkPolicy.clients: "
    "the pods (vLLM's) that use the agents"
)
NETWORK_POLICY_NEEDS_GATEWAYS = (
    "spec.networkPolicy.enabled with spec.index.enabled needs spec.networkPolicy.gateways: "
    "the pods that call the index"
)
NETWORK_POLICY_NEEDS_PICKER_CLIENTS = (
    "spec.networkPolicy.enabled with spec.index.picker.enabled needs "
    "spec.networkPolicy.pickerClients: the gateway pods that call the endpoint picker"
)
_SELECTOR = (
    "A label selector ({} selects everything): matchLabels and matchExpressions must all hold."
)


class NetworkPeer(SpecModel):
    """Pods by podSelector, namespaces by namespaceSelector, or both (a core/v1
    NetworkPolicyPeer without ipBlock)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule("has(self.podSelector) || has(self.namespaceSelector)", PEER_SELECTS_NOTHING)
        )
    )

    pod_selector: LabelSelector | None = Field(None, description=_SELECTOR)
    namespace_selector: LabelSelector | None = Field(None, description=_SELECTOR)

    @model_validator(mode="after")
    def _selects(self) -> Self:
        if self.pod_selector is None and self.namespace_selector is None:
            raise ValueError(PEER_SELECTS_NOTHING)
        return self


Peers = tuple[NetworkPeer, ...]


class NetworkPolicySpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule("!self.enabled || self.clients.size() > 0", NETWORK_POLICY_NEEDS_CLIENTS)
        )
    )

    enabled: bool = Field(
        False, description="Make the NetworkPolicies. Turning it off deletes them."
    )
    clients: Peers = Field(
        (),
        json_schema_extra={"maxItems": 16} | ATOMIC,
        description="Peers admitted to the agents' ZMQ and HTTP ports: the vLLM pods that use "
        "the pool, and the pods of tools that call the agents (kvpool doctor, tenants' quota "
        "clients). Required when enabled.",
    )
    gateways: Peers = Field(
        (),
        json_schema_extra={"maxItems": 16} | ATOMIC,
        description="Peers admitted to the index's port (spec.index): the gateways that ask it "
        "for routes. Required when both spec.index and networkPolicy are enabled.",
    )
    picker_clients: Peers = Field(
        (),
        json_schema_extra={"maxItems": 16} | ATOMIC,
        description="Peers admitted to the endpoint picker's port (spec.index.picker): the "
        "gateway's proxy pods (Envoy) that call it, e.g. a namespaceSelector of the gateway's "
        "namespace with a podSelector of its proxies. The picker takes no token: only this "
        "says who may ask it. Required when networkPolicy, spec.index and its picker are "
        "enabled; nobody else is admitted (not the gateways peers).",
    )
    routers: Peers = Field(
        (),
        json_schema_extra={"maxItems": 16} | ATOMIC,
        description="Peers admitted to the placement events' ports "
        "(spec.index.picker.placementEventsPort and its replay port): routers that read "
        "vLLM's KV events (llm-d, Dynamo). Empty: nobody reaches them.",
    )
    prometheus: Peers = Field(
        (),
        json_schema_extra={"maxItems": 16} | ATOMIC,
        description="Peers admitted to the agents' HTTP port and the index's port to scrape "
        "/metrics (your Prometheus pods). Empty: no scraping but by clients.",
    )

    @model_validator(mode="after")
    def _has_clients(self) -> Self:
        if self.enabled and not self.clients:
            raise ValueError(NETWORK_POLICY_NEEDS_CLIENTS)
        return self
