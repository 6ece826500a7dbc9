"""How the API server reaches the webhook: HTTPS served by kvpool's bounded HTTP server
(:func:`kvpool.common.web.serving.serve_http`), its client configuration either a URL
(``--webhook-url-host``: tests, an operator run outside the cluster) or the operator's
Service (``--webhook-service``: in the cluster, what the chart uses).

Not kopf's own server (:class:`kopf.WebhookServer`, aiohttp): that one reads request heads
and bodies without a deadline once TLS is up, keeps an idle connection for an hour, a
handshake for a minute, and about 1 MiB per connection, as many connections as the file
limit allows; and any pod may connect, as the API server does not authenticate to a webhook.
Here (:data:`LIMITS`) a connection has a few seconds for its TLS handshake, then for its
request head (16 KiB at most) and its body (1 MiB at most, a larger declared one refused
before it is read), and at most :data:`MAX_CONNECTIONS` connections are open, and as many in
their handshake: at the bound the oldest idle one is closed for the new one, so junk
connections cannot lock the API server out.

The server serves what kopf's does: ``POST /<handler id>``, the AdmissionReview handed to
kopf's function and its answer returned as JSON. Its TLS files are those of
``--webhook-cert-dir``, or a CA and a serving certificate made at start
(:mod:`~kvpool.operator.admission.certificates`) in a private temporary directory, removed
on exit. They are re-read every minute, and renewed ones (cert-manager's) are served from
the next connection on, their caBundle published (kopf patches the configuration with
each client configuration :class:`Webhook` yields).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import json
import logging
import shutil
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kopf
from kopf._core.engines.admission import (
    AmbiguousResourceError,
    UnknownResourceError,
    WebhookError,
)
from kopf._kits.webhacks import WebhookContextManager
from starlette.types import Receive, Scope, Send

from kvpool.common.config import HttpLimits
from kvpool.common.web.body_gate import BodyGate
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.common.web.serving import serve_http
from kvpool.operator.admission import certificates

logger = logging.getLogger(__name__)

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


MAX_CONNECTIONS = 64
"""Connections open at once (and as many more in their TLS handshake). The API server, its
only client, opens one per admission call in flight and keeps a few idle."""
LIMITS = HttpLimits(
    max_body_bytes=1 << 20,  # kopf's aiohttp bound too; a pod's review is a few KiB
    max_head_bytes=16 << 10,
    max_header_count=100,
    header_timeout_seconds=5.0,  # the TLS handshake, then the head, each
    body_timeout_seconds=5.0,
    send_timeout_seconds=5.0,
    max_connections=MAX_CONNECTIONS,
)
"""What one connection may cost the operator (see the module's docstring)."""
RENEWAL_CHECK_SECONDS = 60.0
"""How often the TLS files are re-read (kopf's interval)."""


class Webhook(WebhookContextManager):
    """The webhook's bounded HTTPS server, with kvpool's TLS and client configuration."""

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
            files = ServingFiles(directory)
            app = BodyGate(AdmissionApp(fn), auth=None, limits=LIMITS)
            async with serve_http(
                app, options.bind, options.port, LIMITS, tls=files.context
            ) as url:
                port = urlsplit(url).port
                assert port is not None
                logger.info("serving the admission webhook at %s", url)
                while True:
                    yield self._client_config(port, files.ca_bundle)
                    await files.renewal(RENEWAL_CHECK_SECONDS)
                    logger.info("serving renewed TLS files of %s", directory)
        finally:
            if made_dir is not None:
                shutil.rmtree(made_dir, ignore_errors=True)

    def _client_config(self, port: int, ca: bytes) -> kopf.WebhookClientConfig:
        config = kopf.WebhookClientConfig(caBundle=base64.b64encode(ca).decode("ascii"))
        service = self.options.service
        if service is None:
            assert self.options.url_host is not None
            config["url"] = f"https://{_url_host(self.options.url_host)}:{port}"
        else:
            config["service"] = kopf.WebhookClientConfigService(
                namespace=service.namespace, name=service.name, port=service.port
            )
        return config


def _url_host(host: str) -> str:
    """``host`` as a URL's host: an IPv6 address in brackets."""
    try:
        return f"[{ipaddress.IPv6Address(host)}]"
    except ValueError:
        return host


class ServingFiles:
    """A directory's TLS files: the context serving its certificate and key, and the CA bundle
    to publish (its CA file, or the certificate itself if it has none)."""

    def __init__(self, directory: Path) -> None:
        self._cert = directory / certificates.CERT_FILE
        self._key = directory / certificates.KEY_FILE
        self._ca = directory / certificates.CA_FILE
        self._digest = self._files_digest()
        self._context, self.ca_bundle = self._load()

    def context(self) -> ssl.SSLContext:
        """The latest files' context (the server asks at each connection)."""
        return self._context

    async def renewal(self, interval: float) -> None:
        """Return once the files have changed and the new ones are loaded; checks every
        ``interval`` seconds. Files that cannot be loaded (a renewal half written) are
        logged, and the old ones served until the next check."""
        while True:
            await asyncio.sleep(interval)
            digest = self._files_digest()
            if digest == self._digest:
                continue
            try:
                self._context, self.ca_bundle = self._load()
            except OSError as error:  # ssl.SSLError too
                logger.warning("webhook TLS files changed but cannot be loaded: %s", error)
                continue
            self._digest = digest
            return

    def _load(self) -> tuple[ssl.SSLContext, bytes]:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self._cert, self._key)
        return context, (self._ca if self._ca.is_file() else self._cert).read_bytes()

    def _files_digest(self) -> str:
        hasher = hashlib.sha256()  # not the files: no key material stays in memory
        for path in (self._cert, self._key, self._ca):
            if path.is_file():
                hasher.update(path.read_bytes())
        return hasher.hexdigest()


class AdmissionApp:
    """``POST /<webhook id>``: the AdmissionReview to kopf's ``fn``, its answer back as JSON
    (as kopf's aiohttp server: 400 for a body that is no JSON or a review kopf refuses, 404
    for a resource without handlers, 409 for an ambiguous one). The API server sends no
    client certificate, so ``sslpeer`` is empty."""

    def __init__(self, fn: kopf.WebhookFn) -> None:
        self._fn = fn
        self._log = RateLimitedLog(logger)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await _answer(send, 405, {"detail": f"method {scope['method']} not allowed"})
            return
        body = await _read_body(receive)
        if body is None:  # the body gate refused it, or the client left
            return
        status, answer = await self._review(scope, body)
        await _answer(send, status, answer)

    async def _review(self, scope: Scope, body: bytes) -> tuple[int, Any]:
        try:
            review = json.loads(body)
        except ValueError as error:  # not UTF-8, or not JSON
            return 400, {"detail": f"the body is not JSON: {error}"}
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        try:
            return 200, await self._fn(
                review, webhook=scope["path"][1:], headers=headers, sslpeer={}
            )
        except AmbiguousResourceError as error:
            return 409, {"detail": str(error)}
        except UnknownResourceError as error:
            return 404, {"detail": str(error)}
        except WebhookError as error:
            return 400, {"detail": str(error)}
        except Exception:
            self._log.exception("admission webhook: a review failed")
            return 500, {"detail": "the review failed; see the operator's log"}


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer(send: Send, status: int, answer: Any) -> None:
    body = json.dumps(answer).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
