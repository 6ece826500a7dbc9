"""How a pool's pods run: the agent DaemonSet (``spec.agent``) and the resources and
tolerations that the agents and the index both take."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvpool.operator.spec.base import Quantity, SpecModel

Tolerations = tuple[dict[str, Any], ...]
"""core/v1 Tolerations, passed on as written (the CRD keeps their unknown fields)."""


class ResourcesSpec(SpecModel):
    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Requests by resource name (cpu, memory, ...)."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Limits by resource name (cpu, memory, ...)."
    )


class UpdateStrategySpec(SpecModel):
    type: Literal["RollingUpdate", "OnDelete"] = Field(
        "RollingUpdate",
        description="RollingUpdate replaces agents node by node; OnDelete only when you delete "
        "an agent pod. A restarted agent re-adopts its node's segment.",
    )
    max_unavailable: int | str = Field(
        1,
        description="Agents that may be down at once in a rolling update (count or percentage).",
    )


class AgentSpec(SpecModel):
    image: str | None = Field(
        None,
        json_schema_extra={"maxLength": 1024},
        description="Agent image; absent means the operator's own image (one image runs both).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the agent image."
    )
    resources: ResourcesSpec = Field(
        ResourcesSpec(),
        description="Overrides of the agent's resources. By default the memory request and "
        "limit are L1 plus the agent's own needs, and the CPU request is 250m.",
    )
    node_selector: dict[str, str] = Field(
        {}, description="Nodes that run an agent (e.g. your GPU nodes)."
    )
    tolerations: Tolerations = Field(
        (), description="Tolerations of the agent pods (core/v1 Toleration)."
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Affinity of the agent pods (core/v1 Affinity)."
    )
    priority_class_name: str | None = Field(
        None,
        description="PriorityClass of the agent pods.",
        json_schema_extra={"maxLength": 253},
    )
    update_strategy: UpdateStrategySpec = Field(
        UpdateStrategySpec(), description="How a changed pool rolls onto the agents."
    )
