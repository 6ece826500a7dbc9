"""How the API server reaches the webhook: kopf's :class:`kopf.WebhookServer` over HTTPS,
its client configuration either a URL (``--webhook-url-host``: tests, an operator run
outside the cluster) or the operator's Service (``--webhook-service``: in the cluster, what
the chart uses).

kopf yields a ``url`` client configuration; :class:`Webhook` turns it into a ``service``
one when a Service is named (kopf then appends the handler's path), and gives kopf the TLS
files: those of ``--webhook-cert-dir``, or a CA and a serving certificate made at start
(:mod:`~kvpool_operator.admission.certificates`) in a private temporary directory, removed
on exit. kopf re-reads the files every minute and serves the new ones (cert-manager's
renewals), publishing the new caBundle.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import kopf
from kopf._kits.webhacks import WebhookContextManager

from kvpool_operator.admission import certificates

DEFAULT_PORT = 9443
DEFAULT_CONFIGURATION = "kvpool-operator.kvpool.io"
"""The MutatingWebhookConfiguration kopf manages (its webhook: ``cache-pool.<this>``)."""


@dataclass(frozen=True)
class ServiceRef:
    """The Service in front of the webhook: the API server dials ``name.namespace.svc``."""

    namespace: str
    name: str
    port: int = 443

    def hosts(self) -> list[str]:
        base = f"{self.name}.{self.namespace}"
        return [f"{base}.svc", base, self.name, f"{base}.svc.cluster.local"]


@dataclass(frozen=True)
class WebhookOptions:
    """The operator's webhook: where it listens, how the API server reaches it (exactly
    one of ``url_host`` and ``service``), its TLS files (None: made at start), and the
    configuration object kopf manages."""

    bind: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    url_host: str | None = None
    service: ServiceRef | None = None
    cert_dir: Path | None = None
    configuration: str = DEFAULT_CONFIGURATION

    def hosts(self) -> list[str]:
        """The names the serving certificate must carry."""
        if self.service is not None:
            return self.service.hosts()
        assert self.url_host is not None
        return [self.url_host]


class Webhook(WebhookContextManager):
    """kopf's HTTPS server, with kvpool's TLS and client configuration."""

    def __init__(self, options: WebhookOptions) -> None:
        super().__init__()
        self.options = options

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        options = self.options
        made_dir: Path | None = None
        try:
            if options.cert_dir is not None:
                directory = options.cert_dir
            else:
                made_dir = directory = Path(tempfile.mkdtemp(prefix="kvpool-webhook-"))
                certificates.write(certificates.make(options.hosts()), directory)
            ca = directory / certificates.CA_FILE
            server = kopf.WebhookServer(
                addr=options.bind,
                port=options.port,
                host=options.url_host,
                certfile=directory / certificates.CERT_FILE,
                pkeyfile=directory / certificates.KEY_FILE,
                cafile=ca if ca.is_file() else None,
            )
            async with server:
                async for config in server(fn):
                    yield self._client_config(config)
        finally:
            if made_dir is not None:
                shutil.rmtree(made_dir, ignore_errors=True)

    def _client_config(self, served: kopf.WebhookClientConfig) -> kopf.WebhookClientConfig:
        service = self.options.service
        if service is None:
            return served
        config = kopf.WebhookClientConfig(
            service=kopf.WebhookClientConfigService(
                namespace=service.namespace, name=service.name, port=service.port
            )
        )
        if "caBundle" in served:
            config["caBundle"] = served["caBundle"]
        return config
