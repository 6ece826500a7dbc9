"""Pod Security Standards, the "baseline" and "restricted" profiles, as a checker of pod specs.

The rules are those published at
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (policy version
``latest``, Kubernetes 1.35), which the API server's PodSecurity admission enforces on a
namespace labelled ``pod-security.kubernetes.io/enforce: restricted``. No cluster runs
here, so tests check the pod specs kvpool renders or documents for tenants with this.

:func:`restricted` returns one line per broken rule, naming the field and its value
(empty: the pod passes), for both profiles, as "restricted" includes "baseline".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

Spec = Mapping[str, Any]

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
        "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
    }
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
        "projected", "secret",
    }
)  # fmt: skip
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
CONFINED = ("RuntimeDefault", "Localhost")
"""The seccomp profiles "restricted" accepts."""


def restricted(pod: Spec) -> list[str]:
    """Every rule of "baseline" and "restricted" that ``pod`` (a pod's ``spec``) breaks."""
    return [*_baseline(pod), *_restricted(pod)]


def _containers(pod: Spec) -> Iterator[tuple[str, Spec]]:
    for kind in CONTAINER_LISTS:
        for index, container in enumerate(pod.get(kind) or ()):
            yield f"spec.{kind}[{index}] ({container.get('name', '?')})", container


def _baseline(pod: Spec) -> Iterator[str]:
    context = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            yield f"baseline: spec.{field} is true"
    yield from _baseline_context("spec.securityContext", context)
    for sysctl in context.get("sysctls") or ():
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"baseline: spec.securityContext.sysctls names {sysctl.get('name')!r}"
    for volume in pod.get("volumes") or ():
        if "hostPath" in volume:
            yield f"baseline: volume {volume.get('name')!r} is a hostPath"
    for where, container in _containers(pod):
        security = container.get("securityContext") or {}
        if security.get("privileged"):
            yield f"baseline: {where}.securityContext.privileged is true"
        added = set((security.get("capabilities") or {}).get("add") or ())
        if added - BASELINE_CAPABILITIES:
            yield f"baseline: {where} adds capabilities {sorted(added - BASELINE_CAPABILITIES)}"
        if security.get("procMount", "Default") != "Default":
            yield f"baseline: {where}.securityContext.procMount is {security['procMount']!r}"
        yield from _baseline_context(f"{where}.securityContext", security)
        for port in container.get("ports") or ():
            if port.get("hostPort"):
                yield f"baseline: {where} has hostPort {port['hostPort']}"


def _baseline_context(where: str, context: Spec) -> Iterator[str]:
    """The rules a pod's and a container's securityContext share."""
    if (context.get("windowsOptions") or {}).get("hostProcess"):
        yield f"baseline: {where}.windowsOptions.hostProcess is true"
    apparmor = (context.get("appArmorProfile") or {}).get("type", "RuntimeDefault")
    if apparmor not in ("RuntimeDefault", "Localhost"):
        yield f"baseline: {where}.appArmorProfile.type is {apparmor!r}"
    selinux = context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        yield f"baseline: {where}.seLinuxOptions.type is {selinux['type']!r}"
    for field in ("user", "role"):
        if selinux.get(field):
            yield f"baseline: {where}.seLinuxOptions.{field} is set"
    if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield f"baseline: {where}.seccompProfile.type is 'Unconfined'"


def _restricted(pod: Spec) -> Iterator[str]:
    context = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or ():
        kinds = set(volume) - {"name"}
        if kinds - RESTRICTED_VOLUMES:
            yield f"restricted: volume {volume.get('name')!r} is of type {sorted(kinds)}"
    if context.get("runAsUser") == 0:
        yield "restricted: spec.securityContext.runAsUser is 0"
    pod_non_root = context.get("runAsNonRoot") is True
    pod_seccomp = (context.get("seccompProfile") or {}).get("type") in CONFINED
    for where, container in _containers(pod):
        security = container.get("securityContext") or {}
        if security.get("allowPrivilegeEscalation") is not False:
            yield f"restricted: {where}.securityContext.allowPrivilegeEscalation is not false"
        non_root = security.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            yield f"restricted: {where} may run as root (runAsNonRoot is not true)"
        if security.get("runAsUser") == 0:
            yield f"restricted: {where}.securityContext.runAsUser is 0"
        seccomp = (security.get("seccompProfile") or {}).get("type")
        if seccomp not in CONFINED and not (seccomp is None and pod_seccomp):
            yield f"restricted: {where} has no RuntimeDefault or Localhost seccompProfile"
        capabilities = security.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or ()):
            yield f"restricted: {where}.securityContext.capabilities.drop lacks ALL"
        if set(capabilities.get("add") or ()) - {"NET_BIND_SERVICE"}:
            yield f"restricted: {where} adds capabilities {sorted(capabilities['add'])}"
