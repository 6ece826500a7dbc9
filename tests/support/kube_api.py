"""A Kubernetes API server for tests: kmock's emulator over HTTP on loopback, made realistic.

kmock (0.8) keeps objects in memory and merges every write naively. :class:`ApiServer`
makes it behave like a real API server wherever kvpool depends on it:

- paths: ``/api/v1/namespaces[/name]`` is the namespaces resource (kmock 0.8 takes it for
  a namespace prefix; the harness replaces kmock's path parser for that case);
- discovery: kmock's bundled built-in resources, with the core group served as ``v1``
  (kmock says ``/v1``, which breaks kubectl's mapping of ConfigMap, Pod, ...);
- a CustomResourceDefinition that is created registers its resources (kind, scope, short
  names, subresources) and is marked Established;
- metadata: ``uid``, ``creationTimestamp``, ``resourceVersion`` (one counter for every
  object), ``generation`` (bumped when anything but metadata and status changes),
  ``generateName``;
- writes: JSON merge patch (RFC 7386) and JSON patch as specified (one that does not apply,
  a failed ``test`` among them, is refused with 422); a strategic merge
  patch is served as a merge patch (lists are replaced, not merged by key); server-side
  apply creates a missing object and removes the fields that the same field manager
  applied before and applies no longer (lists are atomic; no conflicts, as with
  ``force``); a write that changes nothing is a no-op (no new resourceVersion, no event);
- the status subresource: writes to an object leave its status alone, writes to
  ``/status`` change only the status;
- deletion: an object with finalizers gets a deletionTimestamp; the garbage collector
  deletes, after their owner, the objects whose ownerReferences name its uid
  (background propagation, recursively); a deleted CRD's resources are no longer served;
- lists carry ``kind`` (``<Kind>List``), ``apiVersion`` and the current resourceVersion;
  ``fieldSelector`` on ``metadata.name``/``metadata.namespace`` and equality or
  existence ``labelSelector``s filter lists and watches;
- watches from a resourceVersion replay the events after it (no burst of ADDED); watches
  without one start with ADDED for every object; ``timeoutSeconds`` ends a watch;
- mutating admission (:class:`Admission`): on the creation (POST) of a namespaced object,
  each webhook of the stored MutatingWebhookConfigurations (by name, then in order) whose
  ``rules`` (apiGroups, apiVersions, resources, operations, scope; ``*``), ``objectSelector``
  and ``namespaceSelector`` (the Namespace's labels; absent: every namespace) select it is
  called: an AdmissionReview (admission.k8s.io/v1) POSTed over HTTPS to
  ``clientConfig.url``, the server verified with ``clientConfig.caBundle``, within
  ``timeoutSeconds`` (default 10). The response must be an AdmissionReview that echoes the
  request's uid; ``allowed: false`` fails the create with the response's status; a JSONPatch
  is applied; ``warnings`` reach the client as ``Warning: 299 - "<text>"`` headers. A call
  that fails (refused, TLS, timeout, a bad response) follows ``failurePolicy``: Ignore
  (logged, recorded in :attr:`ApiServer.admissions`) creates the object unchanged, Fail (the
  default) fails the create with 500 ``failed calling webhook "<name>": <why>``;
- validation of the objects of the Gateway API Inference Extension's CRDs (InferencePool,
  ``inference.networking.k8s.io``; the CRD is in ``tests/support/gaie/``) against the
  created CRD's OpenAPI schema and CEL rules (``tests/support/crd_schema.py``), on create
  and on every write: a 422 Invalid that names each broken field or rule.

Not emulated: validation of other objects against OpenAPI schemas and CEL rules
(``test_crd.py`` and ``test_render.py`` check kvpool's offline), defaulting, validating
admission (but PodSecurity:
a pod created in a namespace labelled ``pod-security.kubernetes.io/enforce: baseline`` or
``restricted`` is refused when it breaks that level, checked after the mutating webhooks
with ``tests/support/pod_security.py``), mutating
admission of anything but a POST (updates, server-side apply's creates, cluster-scoped
objects), webhooks reached through a ``service`` clientConfig (such a create fails: there
is no cluster network to resolve a Service in), reinvocation, ``matchPolicy`` (rules match
exactly), ``matchConditions``, authentication, RBAC
(every bearer token may do everything, unless a test denies it a verb: see
:meth:`ServedApi.deny`), controllers (a test writes a DaemonSet's status as its
controller would), protobuf bodies (kubectl sends JSON for custom resources and for
``apply``).

:class:`ServedApi` runs it on a loopback port in a thread of its own, writes a kubeconfig
for it, can refuse chosen writes (:meth:`ServedApi.refuse`) and deny a token a verb as
RBAC does without the grant (:meth:`ServedApi.deny`), and offers a TCP proxy in front of
it that a test can cut to make the API server unreachable.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
import secrets
import ssl
import threading
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import attrs
import jsonpatch
import kmock
import multidict
import yaml
from kmock._internal import enums, parsing, rendering

from tests.support import pod_security
from tests.support.crd_schema import object_errors

_parse_path = parsing.parse_path


def _parse_path_of_namespaces(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads ``/api/v1/namespaces[/name]`` as a namespace prefix; it is a resource."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath("", "v1", "namespaces", None, (parts[3:] or [None])[0])
    return _parse_path(path)


parsing.parse_path = _parse_path_of_namespaces

T = TypeVar("T")
Obj = dict[str, Any]
Key = tuple[kmock.resource, str | None, str]
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
VALIDATED_GROUPS = frozenset({"inference.networking.k8s.io"})
"""The API groups whose objects are validated against their CRD's schema here: the Gateway
API Inference Extension's (InferencePool), a third party's, which kvpool's documents and
examples write and no other test checks. kvpool's own CRDs are checked offline
(``tests/operator/test_crd.py``, the same checker), and the operator repeats their rules."""
MUTATING_WEBHOOKS = kmock.resource(
    "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations"
)
NAMESPACES = kmock.resource("", "v1", "namespaces")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    """Refuse requests of ``method`` on ``plural`` with ``status`` (fault injection)."""

    method: str
    plural: str
    status: int
    message: str


@dataclass(frozen=True)
class Denial:
    """The requests bearing ``token`` may not ``verb`` ``plural``: RBAC without that grant."""

    token: str
    user: str
    """Who the token authenticates as, e.g. ``system:serviceaccount:<namespace>:<name>``."""
    verb: str
    plural: str

    def refusal(self, request: rendering.Request) -> kmock.KubernetesError:
        """The API server's 403, worded as Kubernetes words it."""
        resource = request.resource
        assert resource is not None
        subject = f'{self.plural} "{request.name}"' if request.name else self.plural
        scope = f' in the namespace "{request.namespace}"' if request.namespace else ""
        message = (
            f'{subject} is forbidden: User "{self.user}" cannot {self.verb} resource '
            f'"{self.plural}" in API group "{resource.group}"{scope}'
        )
        details = {"name": request.name, "kind": self.plural}
        return kmock.KubernetesError(
            status=403, reason="Forbidden", message=message, details=details
        )


_VERBS = {
    enums.action.FETCH: "get",
    enums.action.LIST: "list",
    enums.action.WATCH: "watch",
    enums.action.CREATE: "create",
    enums.action.DELETE: "delete",
}


def _verb(request: rendering.Request) -> str:
    """The RBAC verb of a request (an update is ``patch`` or ``update`` by its method)."""
    if request.action == enums.action.UPDATE:
        return "patch" if request.method == "PATCH" else "update"
    return _VERBS[request.action] if request.action is not None else ""


@dataclass(frozen=True)
class AdmissionCall:
    """A webhook the API server called on a create, and what came of it: ``patched``,
    ``unchanged``, ``denied``, ``ignored: <why>`` (a failed call under failurePolicy Ignore)
    or ``failed: <why>``."""

    webhook: str
    namespace: str
    name: str
    outcome: str
    warnings: tuple[str, ...] = ()


class NotEmulated(Exception):
    """What a real API server would do, but the emulator cannot: the create fails (500)."""


class CallFailed(Exception):
    """Calling a webhook failed (the API server's ErrCallingWebhook): failurePolicy applies."""


def matches_selector(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) selects
    ``labels``; absent (None) selects everything, as an empty one does."""
    if selector is None:
        return True
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or ():
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or ()
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {operator!r}")
    return True


def matches_rules(
    rules: list[Mapping[str, Any]], resource: kmock.resource, operation: str, namespaced: bool
) -> bool:
    """A webhook's rules (apiGroups, apiVersions, resources, operations, scope; ``*``) match
    ``operation`` on ``resource``."""

    def among(value: str, allowed: Any) -> bool:
        return "*" in (allowed or ()) or value in (allowed or ())

    return any(
        among(resource.group or "", rule.get("apiGroups"))
        and among(resource.version or "", rule.get("apiVersions"))
        and (
            among(str(resource.plural), rule.get("resources"))
            or "*/*" in (rule.get("resources") or ())
        )
        and among(operation, rule.get("operations"))
        and rule.get("scope", "*") in ("*", "Namespaced" if namespaced else "Cluster")
        for rule in rules
    )


def review(resource: kmock.resource, info: kmock.ResourceInfo, namespace: str, obj: Obj) -> Obj:
    """The AdmissionReview (admission.k8s.io/v1) of creating ``obj``."""
    kind = {"group": resource.group or "", "version": resource.version, "kind": info.kind}
    plural = {
        "group": resource.group or "",
        "version": resource.version,
        "resource": resource.plural,
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": kind,
            "resource": plural,
            "requestKind": kind,
            "requestResource": plural,
            "name": obj.get("metadata", {}).get("name", ""),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "test", "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


async def call_webhook(webhook: Mapping[str, Any], request: Obj) -> Mapping[str, Any]:
    """POST ``request`` to the webhook; its response (the review's ``response``), or
    :class:`CallFailed` saying why not."""
    config = webhook.get("clientConfig") or {}
    url = config.get("url")
    if url is None:
        raise NotEmulated(
            f"webhook {webhook.get('name')!r}: a 'service' clientConfig is not emulated "
            "(no cluster network here); use 'url'"
        )
    if "v1" not in (webhook.get("admissionReviewVersions") or ()):
        raise CallFailed("webhook does not accept v1 AdmissionReview")
    context = ssl.create_default_context()
    if config.get("caBundle"):
        context = ssl.create_default_context(
            cadata=base64.b64decode(config["caBundle"]).decode("ascii")
        )
    seconds = webhook.get("timeoutSeconds") or 10
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=seconds)) as session,
            session.post(f"{url}?timeout={seconds}s", json=request, ssl=context) as response,
        ):
            text = await response.text()
            if response.status != 200:
                raise CallFailed(f"the server responded {response.status}: {text[:200]}")
            answer = json.loads(text)
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        why = str(error) or type(error).__name__
        raise CallFailed(f'failed to call webhook: Post "{url}": {why}') from error
    except json.JSONDecodeError as error:
        raise CallFailed(f"the response is not JSON: {error}") from error
    if (answer.get("apiVersion"), answer.get("kind")) != ("admission.k8s.io/v1", "AdmissionReview"):
        raise CallFailed("expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview")
    payload = answer.get("response") or {}
    if payload.get("uid") != request["request"]["uid"]:
        raise CallFailed(
            f"expected response.uid={request['request']['uid']!r}, got {payload.get('uid')!r}"
        )
    return payload


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)
    _log: list[tuple[kmock.resource, Obj]] = attrs.field(factory=list, init=False)
    _applied: dict[tuple[Key, str], Obj] = attrs.field(factory=dict, init=False)
    faults: list[Fault] = attrs.field(factory=list, init=False)
    denials: list[Denial] = attrs.field(factory=list, init=False)
    admissions: list[AdmissionCall] = attrs.field(factory=list, init=False)
    """Every webhook call, in order."""
    _schemas: dict[kmock.resource, dict[str, Any]] = attrs.field(factory=dict, init=False)
    """The openAPIV3Schema of each served version of a CRD of VALIDATED_GROUPS."""

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is None or resource.plural is None:
            return await super()._handle(request)
        token = _header(request, "Authorization").removeprefix("Bearer ")
        for denial in self.denials:
            if (denial.token, denial.verb, denial.plural) == (
                token,
                _verb(request),
                resource.plural,
            ):
                raise denial.refusal(request)
        for fault in self.faults:
            if request.method == fault.method and resource.plural == fault.plural:
                raise kmock.KubernetesError(
                    status=fault.status, reason="Invalid", message=fault.message
                )
        warnings: list[str] = []
        created: Obj | None = None
        if request.method == "POST":
            created, warnings = await self._admit(request, _body(request))
        if request.method in ("POST", "PATCH", "PUT", "DELETE"):
            async with self._lock:
                obj, status = await self._write(request, created)
            headers = multidict.CIMultiDict(
                [("Warning", f'299 - "{_header_text(warning)}"') for warning in warnings]
            )
            return aiohttp.web.json_response(obj, status=status, headers=headers)
        if request.action == enums.action.FETCH:  # (kmock's own path takes ~20 ms)
            async with self._lock:
                info = self._info(resource)
                key = (resource, request.namespace if info.namespaced else None, request.name)
                found = self._current(key)
            if found is None:
                raise kmock.KubernetesObjectNotFoundError()
            return aiohttp.web.json_response(found)
        if request.action == enums.action.LIST:
            return aiohttp.web.json_response(await self._serve_list(request))
        return await super()._handle(request)

    # discovery

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        document = await super()._serve_version(request)
        assert isinstance(document, dict)
        document["groupVersion"] = document["groupVersion"].lstrip("/")
        return document

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        if resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        return self.resources[resource]

    def _register(self, crd: Obj) -> None:
        names, spec = crd["spec"]["names"], crd["spec"]
        for version in spec["versions"]:
            if version.get("served", True):
                self.resources[kmock.resource(spec["group"], version["name"], names["plural"])] = (
                    kmock.ResourceInfo(
                        kind=names["kind"],
                        singular=names.get("singular", names["kind"].lower()),
                        namespaced=spec["scope"] == "Namespaced",
                        shortnames=names.get("shortNames", ()),
                        categories=names.get("categories", ()),
                        subresources=set(version.get("subresources", {})),
                        verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
                    )
                )
                if spec["group"] in VALIDATED_GROUPS:
                    resource = kmock.resource(spec["group"], version["name"], names["plural"])
                    self._schemas[resource] = version["schema"]["openAPIV3Schema"]
        crd["status"] = {
            "acceptedNames": names,
            "conditions": [
                {"type": kind, "status": "True", "reason": kind, "message": ""}
                for kind in ("NamesAccepted", "Established")
            ],
        }

    def _unregister(self, crd: Obj) -> None:
        """A deleted CRD's resources are served no more (its objects stay stored here, where
        a real API server deletes them first)."""
        spec = crd["spec"]
        for version in spec["versions"]:
            resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            if resource in self.resources:
                del self.resources[resource]
            self._schemas.pop(resource, None)

    def _validate(self, resource: kmock.resource, obj: Obj) -> None:
        """Refuse (422 Invalid, as an API server words it) an object of a validated CRD
        that breaks its schema or a CEL rule (checked on a defaulted copy; the stored object
        is not defaulted)."""
        if resource not in self._schemas:
            return
        errors = object_errors(self._schemas[resource], obj)
        if errors:
            kind = self.resources[resource].kind
            name = obj.get("metadata", {}).get("name", "")
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f'{kind}.{resource.group} "{name}" is invalid: ' + "; ".join(errors),
            )

    # admission

    async def _admit(self, request: rendering.Request, obj: Obj) -> tuple[Obj, list[str]]:
        """The object to create, after the mutating webhooks, and their warnings."""
        resource = request.resource
        assert resource is not None
        info = self._info(resource)
        if not info.namespaced or request.namespace is None:
            return obj, []
        namespace = request.namespace
        obj.setdefault("metadata", {})["namespace"] = namespace
        async with self._lock:
            configurations = sorted(
                (name, copy.deepcopy(stored.raw))
                for (kind, _, name), stored in self.objects.items()
                if kind == MUTATING_WEBHOOKS and not stored.deleted
            )
            found = self._current((NAMESPACES, None, namespace))
        namespace_labels = (found or {}).get("metadata", {}).get("labels") or {}
        warnings: list[str] = []
        for _, configuration in configurations:
            for webhook in configuration.get("webhooks") or ():
                labels = obj["metadata"].get("labels") or {}
                if not (
                    matches_rules(webhook.get("rules") or [], resource, "CREATE", True)
                    and matches_selector(webhook.get("objectSelector"), labels)
                    and matches_selector(webhook.get("namespaceSelector"), namespace_labels)
                ):
                    continue
                obj = await self._call(webhook, review(resource, info, namespace, obj), warnings)
        if resource.plural == "pods":
            _enforce_pod_security(obj, namespace_labels)
        return obj, warnings

    async def _call(self, webhook: Mapping[str, Any], request: Obj, warnings: list[str]) -> Obj:
        """Call one webhook: the object it leaves (patched or not); its warnings added."""
        name = str(webhook.get("name"))
        obj = request["request"]["object"]
        metadata = obj.get("metadata", {})

        def record(outcome: str, said: tuple[str, ...] = ()) -> None:
            self.admissions.append(
                AdmissionCall(name, metadata["namespace"], metadata.get("name", ""), outcome, said)
            )

        try:
            response = await call_webhook(webhook, request)
        except NotEmulated as error:
            record(f"failed: {error}")
            raise kmock.KubernetesError(
                status=500, reason="InternalError", message=f"not emulated: {error}"
            ) from error
        except CallFailed as error:
            if webhook.get("failurePolicy", "Fail") == "Ignore":
                logger.warning("failed calling webhook %r (ignored): %s", name, error)
                record(f"ignored: {error}")
                return obj
            record(f"failed: {error}")
            raise kmock.KubernetesError(
                status=500,
                reason="InternalError",
                message=f'Internal error occurred: failed calling webhook "{name}": {error}',
            ) from error
        said = tuple(str(warning) for warning in response.get("warnings") or ())
        warnings += said
        if not response.get("allowed"):
            status = response.get("status") or {}
            record("denied", said)
            raise kmock.KubernetesError(
                status=int(status.get("code") or 403),
                reason=str(status.get("reason") or "Forbidden"),
                message=f'admission webhook "{name}" denied the request: '
                f"{status.get('message', '')}",
            )
        if not response.get("patch"):
            record("unchanged", said)
            return obj
        try:
            if response.get("patchType") != "JSONPatch":
                raise ValueError(f"unsupported patchType {response.get('patchType')!r}")
            patch = json.loads(base64.b64decode(response["patch"]))
            patched: Obj = jsonpatch.apply_patch(obj, patch)
        except (ValueError, jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
            record(f"failed: {error}", said)
            raise kmock.KubernetesError(
                status=500, reason="InternalError", message=f"Internal error occurred: {error}"
            ) from error
        record("patched", said)
        return patched

    # writes

    async def _write(self, request: rendering.Request, created: Obj | None) -> tuple[Obj, int]:
        resource = request.resource
        assert resource is not None
        info = self._info(resource)
        namespace = request.namespace if info.namespaced else None
        if request.method == "POST":
            body = created if created is not None else _body(request)
            return await self._create(resource, info, namespace, body), 201
        assert request.name is not None
        key: Key = (resource, namespace, request.name)
        current = self._current(key)
        if request.method == "DELETE":
            if current is None:
                raise kmock.KubernetesObjectNotFoundError()
            return await self._delete(key, current), 200
        content_type = _header(request, "Content-Type")
        if content_type.startswith("application/apply-patch"):
            applied = _body(request)
            manager = request.params.get("fieldManager", "")
            previous = self._applied.get((key, manager), {})
            self._applied[key, manager] = copy.deepcopy(applied)
            if current is None:
                return await self._create(resource, info, namespace, applied), 201
            new = _merge(_prune(current, previous, applied), applied)
        elif current is None:
            raise kmock.KubernetesObjectNotFoundError()
        elif request.method == "PUT":
            new = _body(request)
        elif "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(current, request.data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                # as kube-apiserver answers a patch that does not apply (a failed "test" op,
                # kopf's guard on resourceVersion, among them): 422, which a client does not
                # retry as it would a 500
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message=str(error)
                ) from error
        else:
            new = _merge_patch(current, _body(request))
        return await self._update(key, info, current, new, request.subresource), 200

    def _current(self, key: Key) -> Obj | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    async def _publish(self, resource: kmock.resource, kind: str, obj: Obj) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._log.append((resource, event))
        await self._buses[resource].put(event)

    async def _create(
        self, resource: kmock.resource, info: kmock.ResourceInfo, namespace: str | None, obj: Obj
    ) -> Obj:
        metadata = obj.setdefault("metadata", {})
        if "name" not in metadata and "generateName" in metadata:
            metadata["name"] = metadata["generateName"] + secrets.token_hex(3)
        if namespace is not None:
            metadata["namespace"] = namespace
        key: Key = (resource, namespace, metadata["name"])
        if self._current(key) is not None:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists", message="exists")
        self._validate(resource, obj)
        metadata.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            generation=1,
            resourceVersion=self._next_version(),
        )
        if "status" in info.subresources:
            obj.pop("status", None)
        if resource == CRDS:
            self._register(obj)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._publish(resource, "ADDED", obj)
        return obj

    async def _update(
        self,
        key: Key,
        info: kmock.ResourceInfo,
        current: Obj,
        new: Obj,
        subresource: str | None,
    ) -> Obj:
        if "status" in info.subresources:
            # /status writes change the status only; other writes everything else.
            kept, status = (current, new) if subresource == "status" else (new, current)
            new = {key: value for key, value in kept.items() if key != "status"}
            if "status" in status:
                new["status"] = status["status"]
        new = copy.deepcopy(new)
        fixed = ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion")
        new["metadata"] = {
            **new.get("metadata", {}),
            **{
                field: current["metadata"][field] for field in fixed if field in current["metadata"]
            },
        }
        if new == current:
            return current
        self._validate(key[0], new)
        if _spec_of(new) != _spec_of(current):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        new["metadata"]["resourceVersion"] = self._next_version()
        self.objects[key].history.append(new)
        await self._publish(key[0], "MODIFIED", new)
        metadata = new["metadata"]
        if metadata.get("deletionTimestamp") and not metadata.get("finalizers"):
            await self._remove(key, new)
        return new

    async def _delete(self, key: Key, current: Obj) -> Obj:
        metadata = current["metadata"]
        if metadata.get("deletionTimestamp"):
            return current
        if metadata.get("finalizers"):
            changed = {**current, "metadata": {**metadata, "deletionTimestamp": _now()}}
            return await self._update(key, self._info(key[0]), current, changed, None)
        await self._remove(key, current)
        return current

    async def _remove(self, key: Key, obj: Obj) -> None:
        self.objects[key].delete()
        if key[0] == CRDS:
            self._unregister(obj)
        gone = {**obj, "metadata": {**obj["metadata"], "resourceVersion": self._next_version()}}
        await self._publish(key[0], "DELETED", gone)
        uid = obj["metadata"]["uid"]
        for other_key, other in list(self.objects.items()):
            if not other.deleted and any(
                owner.get("uid") == uid
                for owner in other.raw["metadata"].get("ownerReferences", ())
            ):
                await self._delete(other_key, copy.deepcopy(other.raw))

    # reads

    def _listed(self, request: rendering.Request) -> tuple[kmock.resource, list[Obj]]:
        resource = request.resource
        assert resource is not None
        info = self._info(resource)
        namespace = request.namespace if info.namespaced else None
        selected = _selector(request)
        return resource, [
            copy.deepcopy(obj.raw)
            for (kind, obj_namespace, _), obj in self.objects.items()
            if kind == resource
            and not obj.deleted
            and namespace in (None, obj_namespace)
            and selected(obj.raw)
        ]

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            resource, items = self._listed(request)
            info = self._info(resource)
            version = str(self._version)
        api_version = f"{resource.group}/{resource.version}".lstrip("/")
        return {
            "apiVersion": api_version,
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": version},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # start streaming before anything happens
        since = request.params.get("resourceVersion", "")
        async with self._lock:
            resource, items = self._listed(request)
            bus = self._buses[resource]
            mark = await bus.mark()
            if since and since != "0":
                backlog = [
                    event
                    for kind, event in self._log
                    if kind == resource
                    and int(event["object"]["metadata"]["resourceVersion"]) > int(since)
                ]
            else:
                backlog = [{"type": "ADDED", "object": item} for item in items]
        selected = _selector(request)

        def wanted(event: Obj) -> bool:
            metadata = event["object"]["metadata"]
            return request.namespace in (None, metadata.get("namespace")) and selected(
                event["object"]
            )

        loop = asyncio.get_running_loop()
        timeout = float(request.params.get("timeoutSeconds", 0) or 0)
        deadline = loop.time() + timeout if timeout else None
        for event in backlog:
            if wanted(event):
                yield event
        stream = bus.stream(since=mark)
        try:
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                try:
                    event = await asyncio.wait_for(anext(stream), remaining)
                except TimeoutError:
                    return
                if wanted(event):
                    yield event
        finally:
            await bus.unmark(mark)


POD_SECURITY_LABEL = "pod-security.kubernetes.io/enforce"


def _enforce_pod_security(pod: Obj, namespace_labels: Mapping[str, str]) -> None:
    """PodSecurity admission, after the mutating webhooks: a pod of a namespace labelled
    ``pod-security.kubernetes.io/enforce: baseline|restricted`` that breaks the level is
    refused (403), as the API server's built-in admission does."""
    level = namespace_labels.get(POD_SECURITY_LABEL, "privileged")
    if level not in ("baseline", "restricted"):
        return
    problems = [
        problem
        for problem in pod_security.restricted(pod.get("spec") or {})
        if level == "restricted" or problem.startswith("baseline")
    ]
    if problems:
        name = pod.get("metadata", {}).get("name", "")
        raise kmock.KubernetesError(
            status=403,
            reason="Forbidden",
            message=f'pods "{name}" is forbidden: violates PodSecurity "{level}:latest": '
            + "; ".join(problems),
        )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _header(request: rendering.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name.lower()), "")


def _header_text(warning: str) -> str:
    """A warning as a Warning header's quoted text: printable ASCII, quotes escaped."""
    text = "".join(c if c.isascii() and c.isprintable() else "?" for c in warning)
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _body(request: rendering.Request) -> Obj:
    data = request.data if request.data is not None else yaml.safe_load(request.text)
    if not isinstance(data, dict):
        raise kmock.KubernetesError(status=400, reason="BadRequest", message="not an object")
    return copy.deepcopy(data)


def _spec_of(obj: Obj) -> Obj:
    return {key: value for key, value in obj.items() if key not in ("metadata", "status")}


def _merge_patch(current: Obj, patch: Obj) -> Obj:
    """RFC 7386: objects merge, null deletes, anything else replaces."""
    merged = dict(current)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict):  # into {} where there is no object: nulls go
            target = merged.get(key)
            merged[key] = _merge_patch(target if isinstance(target, dict) else {}, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge(current: Obj, applied: Obj) -> Obj:
    """Server-side apply's merge: applied objects merge in, applied values replace."""
    merged = dict(current)
    for key, value in applied.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _prune(current: Obj, previous: Obj, applied: Obj) -> Obj:
    """Drop what a manager applied before and applies no longer."""
    pruned = dict(current)
    for key, value in previous.items():
        if key not in applied:
            pruned.pop(key, None)
        elif isinstance(value, dict) and isinstance(applied[key], dict) and key in pruned:
            pruned[key] = _prune(pruned[key], value, applied[key])
    return pruned


def _selector(request: rendering.Request) -> Callable[[Obj], bool]:
    """fieldSelector (metadata.name, metadata.namespace) and labelSelector (k=v, k)."""
    fields = [
        term.split("=", 1) for term in request.params.get("fieldSelector", "").split(",") if term
    ]
    labels = [term for term in request.params.get("labelSelector", "").split(",") if term]
    for name, _ in fields:
        if name not in ("metadata.name", "metadata.namespace"):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=name)

    def selected(obj: Obj) -> bool:
        metadata = obj.get("metadata", {})
        own = metadata.get("labels", {})
        return all(metadata.get(name.split(".")[1]) == value for name, value in fields) and all(
            own.get(term.split("=", 1)[0]) == term.split("=", 1)[1] if "=" in term else term in own
            for term in labels
        )

    return selected


class Proxy:
    """A loopback TCP proxy to ``upstream``; :meth:`cut` makes it refuse and drop everything."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def open(self) -> None:
        """Listen (again, on the same port once it has one)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


class ServedApi:
    """An :class:`ApiServer` on a loopback port, served from a thread of its own."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.api = ApiServer()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundle with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.api.resources.load_bundled()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stack = contextlib.AsyncExitStack()
        self.url = ""

    def start(self) -> ServedApi:
        self._thread.start()
        self.call(self._open())
        return self

    async def _open(self) -> None:
        await self._stack.enter_async_context(self.api)
        server = await self._stack.enter_async_context(kmock.Server(self.api))
        self.url = f"http://{server.host}:{server.port}"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self._stack.aclose(), timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def call(self, coroutine: Awaitable[T], timeout: float = 30) -> T:
        async def run() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def kubeconfig(self, url: str | None = None, name: str = "kubeconfig") -> Path:
        """A kubeconfig for this server (or for ``url``, e.g. a proxy in front of it)."""
        path = self.workdir / name
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": url or self.url}}],
                    "users": [{"name": "test", "user": {"token": "test"}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                    "current-context": "test",
                }
            )
        )
        return path

    def core_api(self) -> Any:
        """The kubernetes client's CoreV1Api for this server, through its kubeconfig."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(str(self.kubeconfig()), client_configuration=configuration)
        return client.CoreV1Api(client.ApiClient(configuration))

    @contextlib.contextmanager
    def refuse(self, method: str, plural: str, status: int, message: str) -> Iterator[None]:
        fault = Fault(method, plural, status, message)
        self.api.faults.append(fault)
        try:
            yield
        finally:
            self.api.faults.remove(fault)

    @contextlib.contextmanager
    def deny(self, token: str, user: str, verb: str, plural: str) -> Iterator[None]:
        """Answer 403 Forbidden to ``token``'s ``verb`` on ``plural``, as RBAC does for a
        ``user`` without that grant (every other token and verb is still allowed)."""
        denial = Denial(token, user, verb, plural)
        self.api.denials.append(denial)
        try:
            yield
        finally:
            self.api.denials.remove(denial)

    def remove_namespace(self, namespace: str) -> None:
        """Remove the namespace and every object in it at once, finalizers or not: where a
        namespace's deletion ends, for a test's cleanup. Watchers see each object DELETED
        with a deletionTimestamp, as after a real deletion (kopf stops its daemons on it)."""

        async def remove() -> None:
            async with self.api._lock:
                for key, obj in list(self.api.objects.items()):
                    if not obj.deleted and (
                        key[1] == namespace or (key[2] == namespace and key[0] == NAMESPACES)
                    ):
                        body = copy.deepcopy(obj.raw)
                        body["metadata"].setdefault("deletionTimestamp", _now())
                        await self.api._remove(key, body)

        self.call(remove())

    def proxy(self) -> Proxy:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        proxy = Proxy((host, int(port)))
        self.call(proxy.open())
        return proxy

    def objects(self, plural: str, namespace: str | None = None) -> dict[str, Obj]:
        """Stored objects of a resource by name (a consistent copy, read on the server)."""

        async def read() -> dict[str, Obj]:
            async with self.api._lock:
                return {
                    name: copy.deepcopy(obj.raw)
                    for (resource, obj_namespace, name), obj in self.api.objects.items()
                    if resource.plural == plural
                    and not obj.deleted
                    and namespace in (None, obj_namespace)
                }

        return self.call(read())

    def events(self, namespace: str, involved: str) -> list[Mapping[str, Any]]:
        """Events about the object named ``involved``."""
        return [
            event
            for event in self.objects("events", namespace).values()
            if event.get("involvedObject", {}).get("name") == involved
        ]
