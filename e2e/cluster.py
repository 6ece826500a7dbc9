"""A Kubernetes cluster on one machine, just real enough for kvpool's whole flow.

- :class:`ControlPlane`: the API server emulator of ``tests/support/kube_api.py`` on
  loopback, a kubeconfig for kubectl and the operator, and an HTTPS front with its own CA
  for clients that run "in a pod" (``load_incluster_config``: the agents' quota store, the
  vLLM connector's discovery).
- :class:`Kubelet`: runs pods of one :class:`Node` from their spec. Each container runs
  in a mount namespace of its own (``sandbox.py``) where its volumes are mounted at the
  paths the spec names: ConfigMaps and Secrets read from the API server and written to
  files, emptyDirs, hostPaths (under the node's root directory, so that two nodes on one
  machine have two ``/dev/shm``), inline CSI volumes (published by the driver's node
  plugin, which the kubelet finds by its registration socket: :class:`CsiPlugins`), and
  the service account's token, CA and namespace at
  ``/var/run/secrets/kubernetes.io/serviceaccount``. Nothing in the command, args, env or
  files is rewritten, with one exception: pods here share the machine's network, so each
  pod gets a loopback address of its own, and an env value ``0.0.0.0`` (the wildcard of
  the pod's own network) becomes that address.
- A node's mount namespace (:class:`NodeNamespace`): its pods start from it, and its
  kubelet directory is a shared mount there, so that a pod mounting it with
  ``mountPropagation: Bidirectional`` (a CSI plugin, privileged) publishes into it.
- Pod creation: each pod is created through the API server first, as a workload
  controller creates it (admission webhooks and PodSecurity see it), and the kubelet runs
  what the API server stored, then reports it Running with its IP (what the prefix index
  discovers agents by).
- Cluster DNS and kube-proxy: each pod's ``/etc/hosts`` resolves
  ``<service>.<namespace>.svc`` to the ready pod that the Service selects on the pod's
  own node (``internalTrafficPolicy: Local``, the only policy kvpool uses); a Service
  port must then equal its target port, which this emulation checks.

Not emulated: images (every container runs this machine's Python environment, the
"image"), users and security contexts (containers run as root; PodSecurity admission
checks the contexts, nothing applies them), resource limits,
scheduling (a test picks nodes), controllers (a test writes the DaemonSet's status).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from kvpool.operator.admission import certificates
from tests.support.csi_kubelet import CsiClient, notify, plugin_info, target_path, volume_id
from tests.support.kube_api import Proxy, ServedApi
from tests.support.polling import eventually

SANDBOX = Path(__file__).with_name("sandbox.py")
KUBELET_DIR = "/var/lib/kubelet"
"""The kubelet's directory on a node: pods' volumes, plugins and their registration."""
IMAGE = "kvpool-e2e"
"""What a container's image is (every container runs this Python environment)."""
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
WILDCARD = "0.0.0.0"
Manifest = dict[str, Any]
T = TypeVar("T")


class PodExited(RuntimeError):
    """A pod's container exited when it should run; the message ends with its log."""


class SandboxUnavailable(RuntimeError):
    """Containers cannot get mount namespaces here; the message says why."""


def check_sandbox(scratch: Path) -> None:
    """Run one empty container (an overlay and a bind mount) or raise SandboxUnavailable."""
    if not all(shutil.which(tool) for tool in ("unshare", "nsenter", "mount")):
        raise SandboxUnavailable("unshare(1), nsenter(1) and mount(8) are needed to run pods")
    if os.geteuid() != 0:
        raise SandboxUnavailable("a node's mount namespace and its CSI plugin's mounts need root")
    source = scratch / "probe-volume"
    source.mkdir(parents=True, exist_ok=True)
    (source / "probe").write_text("ok")
    target = "/etc/kvpool-e2e-probe/volume"
    spec = {
        "mounts": [[str(source), target, True]],
        "argv": ["cat", f"{target}/probe"],
        "env": {"PATH": os.defpath},
        "scratch": str(scratch / "probe-scratch"),
    }
    spec_path = scratch / "probe.json"
    spec_path.write_text(json.dumps(spec))
    result = subprocess.run(
        [*_unshare(), sys.executable, str(SANDBOX), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0 or result.stdout != "ok":
        raise SandboxUnavailable(
            f"cannot run a container in a mount namespace: {result.stderr.strip()[-400:]}"
        )
    if Path(target).exists():
        raise SandboxUnavailable(f"the container's mount point {target} leaked to the host")


def _unshare(propagation: str = "private") -> list[str]:
    return ["unshare", "--mount", "--propagation", propagation]


class ControlPlane:
    """The API server emulator, kubectl against it, and an HTTPS front for pods."""

    def __init__(self, workdir: Path, kubectl: Path) -> None:
        self.workdir = workdir
        self.kubectl_binary = kubectl
        self.served = ServedApi(workdir)
        self.kubeconfig = workdir / "kubeconfig"
        self.ca = workdir / "ca.crt"
        self._front: Proxy | None = None

    def start(self) -> ControlPlane:
        self.served.start()
        self.kubeconfig = self.served.kubeconfig()
        context = _tls_context(self.workdir, self.ca)
        host, port = self.served.url.removeprefix("http://").rsplit(":", 1)
        self._front = _TlsFront((host, int(port)), context)
        self.served.call(self._front.open())
        return self

    def stop(self) -> None:
        if self._front is not None:
            self.served.call(self._front.cut())
        self.served.stop()

    @property
    def in_cluster_env(self) -> dict[str, str]:
        """What a kubelet tells every pod about the API server."""
        assert self._front is not None
        return {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self._front.port),
        }

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return self.kubectl_warned(*args, stdin=stdin)[0]

    def kubectl_warned(self, *args: str, stdin: str | None = None) -> tuple[str, list[str]]:
        """kubectl's output, and the API server's warnings it printed (admission's)."""
        result = subprocess.run(
            [str(self.kubectl_binary), *args],
            input=stdin,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        warnings = [
            line.removeprefix("Warning: ")
            for line in result.stderr.splitlines()
            if line.startswith("Warning: ")
        ]
        return result.stdout, warnings

    def objects(self, plural: str, namespace: str | None = None) -> dict[str, Manifest]:
        return self.served.objects(plural, namespace)

    def get(self, plural: str, namespace: str, name: str) -> Manifest | None:
        return self.objects(plural, namespace).get(name)


class _TlsFront(Proxy):
    """The harness's TCP proxy, speaking TLS to its clients."""

    def __init__(self, upstream: tuple[str, int], context: ssl.SSLContext) -> None:
        super().__init__(upstream)
        self._context = context

    async def open(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, ssl=self._context
        )
        self.port = self._server.sockets[0].getsockname()[1]


def _tls_context(workdir: Path, ca_path: Path) -> ssl.SSLContext:
    """A CA (written to ``ca_path``) and a server certificate for 127.0.0.1 signed by it,
    made as the operator's webhook makes its own."""
    made = certificates.make(["127.0.0.1", "localhost"])
    ca_path.write_bytes(made.ca)
    chain = workdir / "apiserver.pem"
    chain.write_bytes(made.cert + made.key)
    chain.chmod(0o600)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(chain)
    return context


@dataclass(frozen=True)
class Node:
    name: str
    root: Path
    """The node's file system: hostPath P is ``root / P``."""
    index: int
    """Pods of this node get the loopback addresses 127.77.<index>.<n>."""
    labels: Mapping[str, str] = field(default_factory=dict)

    def host_path(self, path: str) -> Path:
        return self.root / path.lstrip("/")


@dataclass
class Pod:
    name: str
    namespace: str
    node: Node
    ip: str
    labels: dict[str, str]
    spec: Manifest
    directory: Path
    process: subprocess.Popen[str]
    log: Path | None
    warnings: list[str] = field(default_factory=list)
    """What the API server warned of when the pod was created (admission webhooks)."""
    on_stop: list[Callable[[], None]] = field(default_factory=list)
    """What the kubelet does once the pod's container has exited (unpublish its volumes)."""

    @property
    def container(self) -> Manifest:
        (container,) = self.spec["containers"]
        return dict(container)

    def container_port(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        for declared in self.container.get("ports", ()):
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise AssertionError(f"pod {self.name} has no port named {port}")

    def ready(self) -> bool:
        """The readiness probe's verdict (running and no probe: ready)."""
        if self.process.poll() is not None:
            raise AssertionError(
                f"pod {self.name} exited with {self.process.returncode}{self.tail()}"
            )
        probe = self.container.get("readinessProbe")
        if probe is None:
            return True
        get = probe["httpGet"]
        url = f"http://{self.ip}:{self.container_port(get['port'])}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                status: int = response.status
                return 200 <= status < 400
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> Pod:
        def check() -> None:
            assert self.ready(), f"pod {self.name} is not ready"

        eventually(check, timeout, f"pod {self.name} ready")
        return self

    def stop(self, grace: float | None = None) -> int:
        """SIGTERM, then SIGKILL after the grace period, as the kubelet stops a pod."""
        seconds = grace if grace is not None else self.spec.get("terminationGracePeriodSeconds", 30)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        while self.on_stop:
            self.on_stop.pop()()
        return self.process.returncode

    def tail(self) -> str:
        """The last 30 lines of its log, after a colon (empty without a log)."""
        if self.log is None or not self.log.exists():
            return ""
        return ":\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


class Kubelet:
    """Runs pods on one node (see the module docstring for what it emulates)."""

    def __init__(self, control: ControlPlane, node: Node, image_env: Mapping[str, str]) -> None:
        self._control = control
        self.node = node
        self._image_env = dict(image_env)
        self.pods: list[Pod] = []
        self.csi = CsiPlugins(node)
        (node.root / "dev" / "shm").mkdir(parents=True, exist_ok=True)  # every node has one
        self._namespace = NodeNamespace(node.host_path(KUBELET_DIR))
        node.host_path(f"{KUBELET_DIR}/plugins_registry").mkdir()  # the plugin watcher's

    def stop(self) -> None:
        """After its pods: the node's mount namespace goes, and every mount in it."""
        self._namespace.stop()

    def run(
        self,
        name: str,
        namespace: str,
        template: Manifest,
        *,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> Pod:
        """Create the pod of ``template`` (``metadata`` and ``spec``, as in a workload)
        through the API server, as a workload controller does (admission may change it),
        then start what the API server stored."""
        created, warnings = self._create(name, namespace, template)
        spec: Manifest = created["spec"]
        if spec.get("initContainers"):
            raise NotImplementedError(f"{name}: init containers are not emulated")
        (container,) = spec["containers"]
        directory = self.node.root / "pods" / name
        directory.mkdir(parents=True)
        ip = f"127.77.{self.node.index}.{len(self.pods) + 1}"
        unpublish: list[Callable[[], None]] = []
        volumes = {
            volume["name"]: self._volume(volume, created, directory, unpublish)
            for volume in spec.get("volumes", ())
        }
        mounts = []
        propagation = "private"
        for mount in container.get("volumeMounts", ()):
            if "subPath" in mount:
                raise NotImplementedError(f"{name}: subPath mounts are not emulated")
            if mount.get("mountPropagation") == "Bidirectional":
                if not (container.get("securityContext") or {}).get("privileged"):
                    raise AssertionError(f"{name}: Bidirectional propagation needs privileged")
                propagation = "unchanged"  # its mounts reach the node's namespace
            mounts.append(
                [str(volumes[mount["name"]]), mount["mountPath"], bool(mount.get("readOnly"))]
            )
        if spec.get("automountServiceAccountToken", True):
            mounts.append(
                [str(self._service_account(namespace, directory)), SERVICE_ACCOUNT_DIR, True]
            )
        mounts.append([str(self._hosts(name, ip, namespace, directory)), "/etc/hosts", True])
        env = {**self._image_env, **self._control.in_cluster_env}
        env |= self._env_from(container, namespace)
        env |= {
            item["name"]: value
            for item in container.get("env", ())
            if (value := self._env_value(item, namespace, name, ip)) is not None
        }
        if "command" not in container:
            raise NotImplementedError(
                f"{name}: a container without command (the image's entrypoint)"
            )
        sandbox = {
            "mounts": mounts,
            "argv": [*container["command"], *container.get("args", ())],
            "env": env,
            "workdir": container.get("workingDir"),
            "scratch": str(directory / "scratch"),
        }
        (directory / "sandbox.json").write_text(json.dumps(sandbox, indent=1))
        log = None
        if stdout is None:
            log = directory / "log"
            stdout = log.open("w")
            stderr = subprocess.STDOUT
        process = subprocess.Popen(
            [
                *self._namespace.enter(),
                *_unshare(propagation),
                sys.executable,
                str(SANDBOX),
                str(directory / "sandbox.json"),
            ],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=True,
        )
        labels = dict(created["metadata"].get("labels") or {})
        pod = Pod(name, namespace, self.node, ip, labels, spec, directory, process, log)
        pod.warnings, pod.on_stop = warnings, unpublish
        self.pods.append(pod)
        self._report_running(pod)
        return pod

    def _create(self, name: str, namespace: str, template: Manifest) -> tuple[Manifest, list[str]]:
        """POST the pod; the stored object (after admission) and the API server's warnings."""
        spec = {**template["spec"], "nodeName": self.node.name}
        spec["containers"] = [{"image": IMAGE, **c} for c in spec["containers"]]
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": dict(template.get("metadata", {}).get("labels", {})),
            },
            "spec": spec,
        }
        output, warnings = self._control.kubectl_warned(
            "create", "--validate=false", "-o", "json", "-f", "-", stdin=json.dumps(manifest)
        )
        created: Manifest = json.loads(output)
        return created, warnings

    def _report_running(self, pod: Pod) -> None:
        """Write the pod's status to the API server, as a kubelet reports its pods."""
        status = {"phase": "Running", "podIP": pod.ip, "hostIP": f"127.77.{self.node.index}.0"}
        self._control.kubectl(
            "patch", "pod", pod.name, "-n", pod.namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps({"status": status}),
        )  # fmt: skip

    # volumes

    def _volume(
        self,
        volume: Manifest,
        pod: Manifest,
        directory: Path,
        unpublish: list[Callable[[], None]],
    ) -> Path:
        namespace = pod["metadata"]["namespace"]
        path: Path = directory / "volumes" / str(volume["name"])
        if "csi" in volume:
            return self._csi_volume(volume, pod, unpublish)
        if "configMap" in volume:
            source = volume["configMap"]
            found = self._control.get("configmaps", namespace, source["name"])
            assert found is not None, f"ConfigMap {namespace}/{source['name']} is missing"
            data = {key: value.encode() for key, value in (found.get("data") or {}).items()}
            return _files(path, data, source.get("items"), source.get("defaultMode", 0o644))
        if "secret" in volume:
            source = volume["secret"]
            found = self._control.get("secrets", namespace, source["secretName"])
            assert found is not None, f"Secret {namespace}/{source['secretName']} is missing"
            data = {
                key: base64.b64decode(value) for key, value in (found.get("data") or {}).items()
            }
            return _files(path, data, source.get("items"), source.get("defaultMode", 0o644))
        if "emptyDir" in volume:
            path.mkdir(parents=True)
            return path
        if "hostPath" in volume:
            source = volume["hostPath"]
            host: Path = self.node.host_path(source["path"])
            kind = source.get("type", "")
            if kind == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            elif kind == "Directory" and not host.is_dir():
                raise AssertionError(
                    f"hostPath {source['path']} is not a directory on {self.node.name}"
                )
            return host
        raise NotImplementedError(f"volume {volume['name']}: {sorted(volume)} is not emulated")

    def _csi_volume(
        self, volume: Manifest, pod: Manifest, unpublish: list[Callable[[], None]]
    ) -> Path:
        """An inline ephemeral CSI volume: NodePublishVolume on the driver's registered
        plugin, with the pod's identity if its CSIDriver asks for it (``podInfoOnMount``)."""
        source = volume["csi"]
        driver = source["driver"]
        found = self._control.objects("csidrivers").get(driver)
        assert found is not None, f"no CSIDriver {driver}"
        if "Ephemeral" not in found["spec"].get("volumeLifecycleModes", ["Persistent"]):
            raise AssertionError(f"CSIDriver {driver} does not allow inline volumes")
        metadata = pod["metadata"]
        context = {**source.get("volumeAttributes", {}), "csi.storage.k8s.io/ephemeral": "true"}
        if found["spec"].get("podInfoOnMount"):
            context |= {
                "csi.storage.k8s.io/pod.name": metadata["name"],
                "csi.storage.k8s.io/pod.namespace": metadata["namespace"],
                "csi.storage.k8s.io/pod.uid": metadata["uid"],
                "csi.storage.k8s.io/serviceAccount.name": pod["spec"].get(
                    "serviceAccountName", "default"
                ),
            }
        # the kubelet's own path, which the plugin sees at the same place (a hostPath)
        target = str(target_path(Path(KUBELET_DIR), metadata["uid"], volume["name"]))
        self.node.host_path(target).parent.mkdir(parents=True)
        handle = volume_id(metadata["uid"], volume["name"])
        plugin = self.csi.plugin(driver)
        plugin.publish_volume(handle, target, context, readonly=bool(source.get("readOnly")))
        unpublish.append(lambda: plugin.unpublish_volume(handle, target))
        return self.node.host_path(target)

    def _service_account(self, namespace: str, directory: Path) -> Path:
        path = directory / "serviceaccount"
        path.mkdir()
        (path / "token").write_text("token-of-an-emulated-service-account")
        (path / "namespace").write_text(namespace)
        shutil.copy(self._control.ca, path / "ca.crt")
        return path

    def _hosts(self, name: str, ip: str, namespace: str, directory: Path) -> Path:
        """/etc/hosts: the pod's own name, and cluster DNS and kube-proxy for the Services
        of this node."""
        lines = ["127.0.0.1 localhost", f"{ip} {socket.gethostname()} {name}"]
        for space in sorted({pod.namespace for pod in self.pods} | {namespace}):
            for service in self._control.objects("services", space).values():
                target = self._local_endpoint(service)
                if target is None:
                    continue
                name = f"{service['metadata']['name']}.{space}"
                aliases = [f"{name}.svc", f"{name}.svc.cluster.local", name]
                aliases += [service["metadata"]["name"]] if space == namespace else []
                lines.append(f"{target.ip} {' '.join(aliases)}")
        path = directory / "hosts"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _local_endpoint(self, service: Manifest) -> Pod | None:
        spec = service["spec"]
        selector = spec.get("selector") or {}
        if not selector or spec.get("internalTrafficPolicy") != "Local":
            return None
        for pod in self.pods:
            if (
                pod.namespace == service["metadata"]["namespace"]
                and selector.items() <= pod.labels.items()
                and pod.process.poll() is None
                and pod.ready()
            ):
                for port in spec.get("ports", ()):
                    target = pod.container_port(port.get("targetPort", port["port"]))
                    if target != port["port"]:
                        raise NotImplementedError(
                            f"Service {service['metadata']['name']}: port {port['port']} -> "
                            f"{target}; this kube-proxy maps names to pod addresses only"
                        )
                return pod
        return None

    # environment

    def _env_value(self, item: Manifest, namespace: str, pod: str, ip: str) -> str | None:
        if "value" in item:
            value = str(item["value"])
            return ip if value == WILDCARD else value
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            fields = {
                "metadata.name": pod,
                "metadata.namespace": namespace,
                "spec.nodeName": self.node.name,
                "status.podIP": ip,
            }
            return fields[source["fieldRef"]["fieldPath"]]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            data = (self._control.get("secrets", namespace, ref["name"]) or {}).get("data", {})
            if ref["key"] not in data and ref.get("optional"):
                return None
            return base64.b64decode(data[ref["key"]]).decode()
        raise NotImplementedError(f"env {item['name']}: {source} is not emulated")

    def _env_from(self, container: Manifest, namespace: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", ()):
            if "secretRef" in source:
                secret = self._control.get("secrets", namespace, source["secretRef"]["name"])
                assert secret is not None, f"Secret {source['secretRef']['name']} is missing"
                env |= {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
            elif "configMapRef" in source:
                found = self._control.get("configmaps", namespace, source["configMapRef"]["name"])
                assert found is not None, f"ConfigMap {source['configMapRef']['name']} is missing"
                env |= found.get("data", {})
            else:
                raise NotImplementedError(f"envFrom {source} is not emulated")
        return env


def _files(path: Path, data: Mapping[str, bytes], items: Any, mode: int) -> Path:
    """A ConfigMap or Secret volume: a file per key (or per item, at its path)."""
    path.mkdir(parents=True)
    chosen = [(item["key"], item["path"]) for item in items] if items else [(k, k) for k in data]
    for key, relative in chosen:
        file = path / relative
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data[key])
        file.chmod(mode)
    return path


class NodeNamespace:
    """A node's mount namespace, where its pods start (each in a namespace of its own made
    from this one) and where its kubelet directory is a shared mount: a pod that mounts
    that directory with ``mountPropagation: Bidirectional`` (a CSI plugin) publishes
    volumes there, which the pods started after see, as on a real node; nothing of it
    reaches the machine's own mount table."""

    def __init__(self, kubelet_dir: Path) -> None:
        kubelet_dir.mkdir(parents=True, exist_ok=True)
        self._holder = subprocess.Popen(
            [*_unshare(), "sleep", "infinity"], stdin=subprocess.DEVNULL
        )
        own = os.readlink("/proc/self/ns/mnt")

        def unshared() -> None:  # before, /proc/<pid>/ns/mnt is the machine's namespace
            assert self._holder.poll() is None, "unshare exited"
            assert os.readlink(f"/proc/{self._holder.pid}/ns/mnt") != own, "not unshared yet"

        eventually(unshared, 10, "the node's mount namespace")
        share = f"mount --bind {kubelet_dir} {kubelet_dir} && mount --make-shared {kubelet_dir}"
        subprocess.run([*self.enter(), "sh", "-c", share], check=True, timeout=30)

    def enter(self) -> list[str]:
        """The command prefix that runs a command in this namespace."""
        return ["nsenter", f"--mount=/proc/{self._holder.pid}/ns/mnt", "--"]

    def stop(self) -> None:
        self._holder.kill()
        self._holder.wait()


class CsiPlugins:
    """The kubelet's plugin watcher: a node plugin that serves its registration socket in
    ``<kubelet dir>/plugins_registry`` is asked for its driver's name and endpoint, told it
    is registered, and from then on called for that driver's volumes."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._plugins: dict[str, CsiClient] = {}

    def wait_registered(self, driver: str, timeout: float = 30.0) -> dict[str, str]:
        """Register ``driver``'s plugin once its socket answers; what it said of itself."""

        def registered() -> dict[str, str]:
            registry = self._node.host_path(f"{KUBELET_DIR}/plugins_registry")
            sockets = sorted(registry.glob("*.sock")) if registry.is_dir() else []
            assert sockets, f"no registration socket in {registry}"
            for socket_path in sockets:
                info = plugin_info(socket_path)
                if info.name == driver:
                    self._plugins[driver] = CsiClient(self._node.host_path(info.endpoint))
                    notify(socket_path, True)
                    return {"type": info.type, "name": info.name, "endpoint": info.endpoint}
            raise AssertionError(f"no plugin of {driver} registered")

        return eventually(registered, timeout, f"the CSI plugin of {driver}")

    def plugin(self, driver: str) -> CsiClient:
        assert driver in self._plugins, f"no CSI plugin of {driver} on {self._node.name}"
        return self._plugins[driver]
