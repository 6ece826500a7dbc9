"""The connector's identity toward its agent: its token, found where a pod or a user puts it.

In order: ``KVPOOL_CONNECTOR_TOKEN`` (a pod sets it from its team's Secret, key ``token``,
with ``valueFrom.secretKeyRef``), the file ``KVPOOL_CONNECTOR_TOKEN_FILE`` names, the file
``kv_connector_extra_config`` names (``token_file``: a mounted Secret), and on a machine
running the embedded default, the engine token its agent generated
(``~/.local/state/kvpool/engine-token-<pool>``). A file is read at every (re)connection,
so a rotated Secret takes effect without restarting vLLM. The variables' old names
(``KVPOOL_TOKEN``, ``KVPOOL_TOKEN_FILE``) are read as
:func:`~kvpool.connector.settings.variables` says.

Without any, :class:`CredentialMissing` says where to put one, in one line; the link
treats it as an outage (vLLM goes on without the cache) and tries again later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from kvpool.client import TokenFileError, read_token
from kvpool.common.names import (
    CONNECTOR_TOKEN_ENV,
    CONNECTOR_TOKEN_FILE_ENV,
    DEFAULT_POOL,
    DEFAULT_STATE_DIR,
    generated_token_path,
)
from kvpool.connector.settings import ConnectorSettings, variables

Credential = Callable[[], str]
"""Returns the token to say hello with; raises :class:`CredentialMissing`."""


class CredentialMissing(ConnectionError):
    """No token for the agent could be found or read; the message says where to put one."""


def credential(
    settings: ConnectorSettings,
    environ: Mapping[str, str] | None = None,
    state_dir: Path = DEFAULT_STATE_DIR,
) -> Credential:
    """The connector's token source (see the module docstring); ``state_dir``: where an
    agent of the embedded default on this machine keeps its generated tokens."""
    env = variables(environ)
    if CONNECTOR_TOKEN_ENV in env:
        token = env[CONNECTOR_TOKEN_ENV][1].strip()
        return lambda: token
    named = env.get(CONNECTOR_TOKEN_FILE_ENV, ("", ""))[1] or settings.token_file
    path = Path(named) if named else None
    default = generated_token_path(state_dir, "engine", settings.pool or DEFAULT_POOL)

    def read() -> str:
        try:
            if path is not None:
                return read_token(path)
            if default.exists():
                return read_token(default)
        except TokenFileError as error:
            raise CredentialMissing(str(error)) from error
        raise CredentialMissing(
            f"no token for the kvpool agent: set {CONNECTOR_TOKEN_ENV} (a KVCacheTenant's "
            f"Secret, key 'token'), {CONNECTOR_TOKEN_FILE_ENV} or kv_connector_extra_config "
            f"'token_file' (no {default} either)"
        )

    return read
