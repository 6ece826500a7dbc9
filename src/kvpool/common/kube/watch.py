"""Following objects through the Kubernetes API: the client configuration, and list-then-watch.

:func:`api_configuration` reaches the API server as a pod does (its service account) or,
outside a cluster, through the kubeconfig (``$KUBECONFIG``).

:class:`ListWatch` follows the objects of one kind in one namespace that a selector picks,
in a thread of its own: it lists them, hands the complete set to ``on_change``, then
watches from the list's resourceVersion and hands the set over again after every event.
When the watch ends (the server's timeout, a 410 for a resourceVersion too old) it lists
again; when the API server fails or cannot be reached it retries after ``retry_seconds``.
Consumers derive what they need from the set (agent endpoints, a ConfigMap's quotas) and
ignore calls that change nothing for them. :func:`connect_config_map` and
:func:`watch_config_map` set it up for one named ConfigMap (the pool's quotas, its tenants).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, cast

import urllib3
import yaml
from kubernetes import config as kube_config
from kubernetes.client import ApiClient, Configuration, CoreV1Api
from kubernetes.client.exceptions import ApiException

from kvpool.common.problems import ConfigError, show, yaml_problem

log = logging.getLogger(__name__)

Manifest = Mapping[str, Any]
ObjectsListener = Callable[[dict[str, Manifest]], None]
"""Receives every followed object, by name, each time one of them changes."""


def api_configuration() -> Configuration:
    """This pod's service account in a pod, else the kubeconfig; ConfigException if neither."""
    configuration = Configuration()
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        kube_config.load_incluster_config(client_configuration=configuration)
    else:
        kube_config.load_kube_config(
            os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return configuration


def checked_api_configuration() -> Configuration:
    """:func:`api_configuration`, or :class:`ConfigError` in one line naming where the
    credentials were looked for and why they are unusable. Nothing is asked of the API
    server: a component refuses to start without credentials, not without an API server."""
    try:
        return api_configuration()
    except (kube_config.ConfigException, yaml.YAMLError, OSError) as error:
        problem = f"{_credentials_source()}: no Kubernetes credentials: {_why(error)}"
        raise ConfigError([problem]) from error


def _credentials_source() -> str:
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        return f"in-cluster service account (KUBERNETES_SERVICE_HOST={show(host)})"
    if "KUBECONFIG" in os.environ:
        return f"KUBECONFIG={show(os.environ['KUBECONFIG'])}"
    return "KUBECONFIG (not set: ~/.kube/config)"


def _why(error: Exception) -> str:
    if isinstance(error, yaml.YAMLError):
        return f"not YAML: {yaml_problem(error)}"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return " ".join(str(error).split())


def connect_config_map(reference: str) -> tuple[CoreV1Api, str, str]:
    """The API, namespace and name of ConfigMap ``namespace/name`` (see :func:`api_configuration`).

    ValueError for a malformed reference, ConfigException without access to the API.
    """
    namespace, _, name = reference.partition("/")
    if not namespace or not name:
        raise ValueError(f"expected a ConfigMap as namespace/name, got {reference!r}")
    return CoreV1Api(ApiClient(api_configuration())), namespace, name


def watch_config_map(
    api: CoreV1Api,
    namespace: str,
    name: str,
    *,
    timeout: float = 10.0,
    retry_seconds: float = 2.0,
    watch_seconds: int = 300,
) -> ListWatch:
    """A :class:`ListWatch` of the one ConfigMap ``namespace/name`` (absent: an empty set)."""
    return ListWatch(
        api.list_namespaced_config_map,
        namespace,
        selectors={"field_selector": f"metadata.name={name}"},
        what=f"ConfigMap {namespace}/{name}",
        timeout=timeout,
        retry_seconds=retry_seconds,
        watch_seconds=watch_seconds,
    )


class ListWatch:
    def __init__(
        self,
        list_objects: Callable[..., Any],
        namespace: str,
        *,
        selectors: Mapping[str, str],
        what: str,
        timeout: float = 10.0,
        retry_seconds: float = 2.0,
        watch_seconds: int = 300,
    ) -> None:
        """``list_objects`` is a ``CoreV1Api.list_namespaced_*`` method (or a stand-in with
        its signature, called with ``_preload_content=False``); ``selectors`` its
        ``label_selector``/``field_selector`` arguments; ``what`` names the objects in logs."""
        self.what = what
        self._list_objects = list_objects
        self._namespace = namespace
        self._selectors = dict(selectors)
        self._timeout = timeout
        self._retry_seconds = retry_seconds
        self._watch_seconds = watch_seconds
        self._objects: dict[str, Manifest] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._thread: threading.Thread | None = None

    def start(self, on_change: ObjectsListener, *, thread_name: str) -> None:
        """Follow the objects; ``on_change`` runs in the watch thread."""
        self._thread = threading.Thread(
            target=self._run, args=(on_change,), name=thread_name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            response = self._response
        if response is not None:
            response.shutdown()  # wakes the watch thread from its blocking read
        if self._thread is not None:
            self._thread.join(self._timeout)

    def _run(self, on_change: ObjectsListener) -> None:
        while not self._stopping.is_set():
            try:
                self._follow(self._list(on_change), on_change)
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as error:
                if self._stopping.is_set():
                    return
                log.warning(
                    "watching %s failed (%s); retrying in %ss",
                    self.what,
                    error,
                    self._retry_seconds,
                )
                self._stopping.wait(self._retry_seconds)

    def _list(self, on_change: ObjectsListener) -> str:
        """Hand over the objects now; returns the resourceVersion to watch from."""
        response = self._list_objects(
            self._namespace,
            **self._selectors,
            _preload_content=False,
            _request_timeout=self._timeout,
        )
        listed: dict[str, Any] = json.loads(response.data)
        self._objects = {_name(item): item for item in listed.get("items") or []}
        on_change(dict(self._objects))
        return str((listed.get("metadata") or {}).get("resourceVersion") or "")

    def _follow(self, version: str, on_change: ObjectsListener) -> None:
        """Hand over the objects after every change since ``version``, until the watch ends."""
        response = cast(
            urllib3.BaseHTTPResponse,
            self._list_objects(
                self._namespace,
                **self._selectors,
                watch=True,
                resource_version=version,
                timeout_seconds=self._watch_seconds,
                _preload_content=False,
                _request_timeout=(self._timeout, self._watch_seconds + self._timeout),
            ),
        )
        with self._lock:
            self._response = response
        try:
            if self._stopping.is_set():
                return
            for line in response:
                if not line.strip():
                    continue
                event: dict[str, Any] = json.loads(line)
                kind, item = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if item.get("code") == 410:
                        return  # our resourceVersion is too old: list again
                    raise ValueError(f"watch error: {item.get('message')}")
                if kind in ("ADDED", "MODIFIED"):
                    self._objects[_name(item)] = item
                elif kind == "DELETED":
                    self._objects.pop(_name(item), None)
                else:
                    continue  # BOOKMARK
                on_change(dict(self._objects))
        finally:
            with self._lock:
                self._response = None
            response.release_conn()


def _name(item: Manifest) -> str:
    return str((item.get("metadata") or {}).get("name", ""))
