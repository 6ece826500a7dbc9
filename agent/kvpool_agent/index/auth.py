"""Who may ask the index: gateway tokens, and the pool's admin tokens.

The index reads the pool's tokens file (the same Secret the agents mount),
with one more top-level key::

    admin: [token, ...]       # may use the index too
    gateways: [token, ...]    # or a single string: may use the index, nothing else
    tenants: {...}            # ignored here: tenants never ask the index

Gateway tokens reach routing answers only; they are no good on an agent's
HTTP API. Digests, constant-time comparison and generated tokens are
:class:`~kvpool_agent.auth.TokenAuthority`'s, one authority per role.
Error messages name an entry by position, never by value.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from kvpool_agent.auth import TokenAuthority, TokenFileError

_TOKEN = re.compile(r"[\x21-\x7e]+")
_TOP_LEVEL_KEYS = ("admin", "gateways", "tenants")


class Role(enum.StrEnum):
    ADMIN = "admin"
    GATEWAY = "gateway"


class GatewayAuthority:
    def __init__(self, authorities: Mapping[Role, TokenAuthority]) -> None:
        if not authorities:
            raise TokenFileError("no admin or gateway tokens: nobody could use the index")
        self._authorities = dict(authorities)

    @classmethod
    def from_file(cls, path: Path) -> GatewayAuthority:
        try:
            parsed = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError) as error:
            raise TokenFileError(f"cannot read tokens file {path}: {error}") from error
        except yaml.YAMLError:
            # The error's own text quotes the offending line, which may hold a token.
            raise TokenFileError(f"{path}: not valid YAML or JSON") from None
        if not isinstance(parsed, Mapping):
            raise TokenFileError(f"{path}: expected a mapping with keys 'admin' and 'gateways'")
        unknown = sorted(str(key) for key in parsed if key not in _TOP_LEVEL_KEYS)
        if unknown:
            raise TokenFileError(
                f"{path}: unknown keys {', '.join(unknown)}; expected {', '.join(_TOP_LEVEL_KEYS)}"
            )
        authorities: dict[Role, TokenAuthority] = {}
        if parsed.get("admin"):
            authorities[Role.ADMIN] = TokenAuthority({"admin": parsed["admin"]}, source=str(path))
        if parsed.get("gateways"):
            tokens = _gateway_tokens(parsed["gateways"], f"{path}: gateways")
            authorities[Role.GATEWAY] = TokenAuthority({"admin": tokens}, source=str(path))
        try:
            return cls(authorities)
        except TokenFileError as error:
            raise TokenFileError(f"{path}: {error}") from None

    @classmethod
    def generate(cls, path: Path) -> GatewayAuthority:
        """A fresh random token in ``path`` (mode 0600) for local use; it has the admin role."""
        return cls({Role.ADMIN: TokenAuthority.generate_admin_token(path)})

    def authenticate(self, token: str) -> Role | None:
        """The role of ``token``, or None; every role's digests are compared, every time."""
        found = [
            role for role, authority in self._authorities.items() if authority.authenticate(token)
        ]
        return found[0] if found else None


def load_gateway_authority(tokens_file: Path | None, generated_file: Path) -> GatewayAuthority:
    if tokens_file is not None:
        return GatewayAuthority.from_file(tokens_file)
    return GatewayAuthority.generate(generated_file)


def _gateway_tokens(value: object, where: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise TokenFileError(f"{where}: expected a token or a list of tokens")
    for position, item in enumerate(items, start=1):
        if not isinstance(item, str) or not _TOKEN.fullmatch(item):
            raise TokenFileError(
                f"{where}: token #{position} is not a string of visible ASCII characters"
            )
    return items
