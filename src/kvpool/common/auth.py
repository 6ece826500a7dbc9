"""Bearer tokens of the pool's APIs: who is calling, admin, one tenant, an engine, an index
or a gateway.

Tokens come from a YAML or JSON file (the pool's Secret, mounted by the agents and by
the prefix index alike)::

    admins: [token, ...]           # or a single string: everything, on every API
    tenants:
      "<tenant-id>": [token, ...]  # or a single string; quote ids in YAML
    engines: [token, ...]          # vLLM engines that serve many tenants' salts
    indexes: [token, ...]          # prefix indexes following the agents
    gateways: [token, ...]         # or a single string: the index's routing API only
    spaces:                        # shared spaces (by their salt's tenant id)
      "<tenant-id>": {members: [tenant id, ...], owners: [tenant id, ...]}

Which principal may use which route or operation is the APIs' business (:class:`Principal`
only says who is calling): the agent's HTTP API refuses gateway, engine and index tokens,
its ZMQ port gateway tokens (see :mod:`kvpool.agent.edge.zmq_server`), the index tenant
tokens.

A shared space is a tenant id that other tenants' tokens may act for: its members may
look up, store and load its chunks, its owners may also pin and warm them
(:meth:`TokenAuthority.may_use`, :meth:`TokenAuthority.may_pin`); nobody's token is the
space's own, so only an admin changes its quota or clears it. Of the agent's chunk files,
handed out by its door (:mod:`kvpool.agent.edge.door`), a member maps a space's read-only
(:meth:`TokenAuthority.file_access`).

A file's tokens must be hard to guess (:data:`MIN_TOKEN_CHARS` characters, of
:data:`MIN_DISTINCT_CHARS` different ones, as ``openssl rand -hex 24`` makes them): an API
that a weak admin token opens is open to whoever can reach it and try.
``admin`` is the old name of ``admins`` (every other key is plural): read, with a warning.

Only the SHA-256 digests of the tokens stay in memory, and every check compares
digests with :func:`hmac.compare_digest` against every known token, so neither
a memory dump nor response timing gives a token away. Error messages name the
offending entry by position, never by value, and nothing here logs a token.

Without a tokens file the agent (and the index) generates tokens at start
(:func:`load_authority`, :class:`GeneratedTokens`): a fresh admin, engine and index token
each is written to a file readable only by the agent's user (mode 0600) once the agent has
started, and the authority keeps their digests.

Beside the file's tokens, an authority accepts digests granted at run time
(:meth:`TokenAuthority.replace_granted`: the KVCacheTenants' tokens and the
operator's, from the pool's tenants ConfigMap). Each call replaces the granted set
whole, in one assignment, so a request sees the old set or the new one, never a mix,
and a digest left out stops working at once.
"""

from __future__ import annotations

import difflib
import enum
import hmac
import logging
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvpool.common.files import check_replaceable, ensure_directory, write_file
from kvpool.common.keys import CANARY_TENANT, TENANT_ID_RULE, check_tenant_id, is_tenant_id
from kvpool.common.tenants_configmap import digest_token

log = logging.getLogger(__name__)

# Visible ASCII only: what fits in an Authorization header without quoting.
_TOKEN = re.compile(r"[\x21-\x7e]+")
_TOP_LEVEL_KEYS = ("admins", "tenants", "engines", "indexes", "gateways", "spaces")
_KEYS_TEXT = ", ".join(f"'{key}'" for key in _TOP_LEVEL_KEYS)
_OLD_KEYS = {"admin": "admins"}
"""Keys of earlier releases, still read (with a warning), and their names now."""
MIN_TOKEN_CHARS = 32
"""The shortest token a tokens file may hold: 128 bits as hex (``openssl rand -hex 16``);
kvpool's own are longer (``secrets.token_urlsafe(32)``: 43 characters)."""
MIN_DISTINCT_CHARS = 8
"""Different characters a file's token needs at least: ``aaaa...`` is long, not random (32
random hex digits show fewer with a chance of 4 in 100 million)."""
TOKEN_FILE_MODE = 0o600
"""A generated token: for the agent's user (and whoever reads it as that user) only."""


class TokenFileError(ValueError):
    """The tokens file cannot be read or does not have the expected shape."""


class Role(enum.StrEnum):
    ADMIN = "admin"
    TENANT = "tenant"
    GATEWAY = "gateway"
    ENGINE = "engine"
    """A vLLM engine serving many tenants' salts: any tenant's chunks, nothing else."""
    INDEX = "index"
    """A prefix index: the agent's key snapshot and chunk events, nothing else."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for: the admin, one tenant (``tenant`` set), an engine, an index
    or a gateway."""

    role: Role
    tenant: str | None = None

    @classmethod
    def admin(cls) -> Principal:
        return cls(Role.ADMIN)

    @classmethod
    def for_tenant(cls, tenant: str) -> Principal:
        return cls(Role.TENANT, check_tenant_id(tenant))

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def may_access(self, tenant: str) -> bool:
        """Whether this principal may read and change ``tenant``'s quota and cache."""
        return self.is_admin or (self.role is Role.TENANT and self.tenant == tenant)

    def __str__(self) -> str:
        return f"tenant {self.tenant}" if self.role is Role.TENANT else str(self.role)


ADMIN = Principal.admin()
GATEWAY = Principal(Role.GATEWAY)
ENGINE = Principal(Role.ENGINE)
INDEX = Principal(Role.INDEX)
_SHARED_ROLES = (("engines", ENGINE), ("indexes", INDEX), ("gateways", GATEWAY))
"""The tokens file's keys of roles that are not one tenant's, and their principals."""


Grant = tuple[bytes, Principal]
"""A token's SHA-256 digest (raw bytes) and the principal it stands for."""


class FileAccess(enum.StrEnum):
    """How a principal may map an L1 account's chunk file (:meth:`TokenAuthority.file_access`)."""

    READ_WRITE = "read-write"
    READ_ONLY = "read-only"


@dataclass(frozen=True, slots=True)
class SpaceAccess:
    """Who may act for a shared space: its members, and its owners (who may also pin)."""

    members: frozenset[str] = frozenset()
    owners: frozenset[str] = frozenset()


class TokenAuthority:
    """Maps bearer tokens to principals, knowing only the tokens' SHA-256 digests."""

    def __init__(
        self, tokens: Mapping[str, object], *, source: str = "tokens", strong_only: bool = False
    ) -> None:
        """Build from the parsed mapping ``{admins: ..., tenants: {id: ...}, gateways: ...}``.

        ``source`` names the mapping in error messages (the file path, usually).
        ``strong_only``: refuse a token that is easy to guess (a file's, which a person
        wrote; not the tokens a program made for itself). Raises :class:`TokenFileError` on
        a malformed mapping.
        """
        if not isinstance(tokens, Mapping):
            raise TokenFileError(
                f"{source}: expected a mapping with keys {_KEYS_TEXT}, got {type(tokens).__name__}"
            )
        unknown = [key for key in tokens if key not in _TOP_LEVEL_KEYS and key not in _OLD_KEYS]
        if unknown:
            raise TokenFileError(f"{source}: {_unknown_keys(unknown)}; expected {_KEYS_TEXT}")
        tokens = _renamed(tokens, source)
        self._entries: list[Grant] = []
        owners: dict[bytes, Principal] = {}
        self._strong_only = strong_only
        for token in self._token_list(tokens.get("admins"), f"{source}: admins"):
            self._add(owners, token, ADMIN, f"{source}: admins")
        tenants = tokens.get("tenants")
        if tenants is None:
            tenants = {}
        if not isinstance(tenants, Mapping):
            raise TokenFileError(
                f"{source}: 'tenants' must map tenant ids to tokens, got {type(tenants).__name__}"
            )
        for position, (tenant, value) in enumerate(tenants.items(), start=1):
            if not isinstance(tenant, str):
                raise TokenFileError(
                    f"{source}: tenant #{position} is a {type(tenant).__name__}, not a string "
                    "(quote tenant ids in YAML)"
                )
            if not is_tenant_id(tenant):
                raise TokenFileError(
                    f"{source}: tenant #{position} ({_glimpse(tenant)}): {TENANT_ID_RULE}"
                )
            where = f"{source}: tenant {tenant}"
            for token in self._token_list(value, where):
                self._add(owners, token, Principal(Role.TENANT, tenant), where)
        for key, principal in _SHARED_ROLES:
            for token in self._token_list(tokens.get(key), f"{source}: {key}"):
                self._add(owners, token, principal, f"{source}: {key}")
        if not self._entries:
            raise TokenFileError(f"{source}: defines no tokens; nobody could use the API")
        self._own = tuple(self._entries)
        self._owners = owners
        self._own_spaces = _spaces(tokens.get("spaces"), source)
        self._spaces = self._own_spaces
        self._generation = 0

    @classmethod
    def from_file(cls, path: Path) -> TokenAuthority:
        """Read a YAML or JSON tokens file; :class:`TokenFileError` says what is wrong,
        after the file's path (``/etc/kvpool/tokens.yaml: ...``)."""
        try:
            text = path.read_text()
        except OSError as error:
            raise TokenFileError(f"{path}: cannot read tokens file: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise TokenFileError(f"{path}: not UTF-8 text (byte {error.start})") from None
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as error:
            # The error's own text quotes the offending line, which may hold a token.
            raise TokenFileError(f"{path}: not valid YAML or JSON{_position(error)}") from None
        if parsed is None:
            raise TokenFileError(f"{path}: the file is empty; it defines no tokens")
        return cls(parsed, source=str(path), strong_only=True)

    def authenticate(self, token: str) -> Principal | None:
        """The principal of ``token``, or None if it is unknown.

        Compares against every known digest without stopping early, so the time
        taken does not depend on which entry (if any) matches.
        """
        digest = digest_token(token)
        found: Principal | None = None
        for known, principal in self._entries:  # one read: a concurrent swap is seen whole
            if hmac.compare_digest(digest, known):
                found = principal
        return found

    def holds(self, digest: bytes, principal: Principal) -> bool:
        """Whether the token of ``digest`` (one this authority accepted before) still stands
        for ``principal``: false once it is revoked. Not for checking a caller's token (use
        :meth:`authenticate`): a dictionary lookup, not constant-time."""
        return self._owners.get(digest) == principal

    @property
    def generation(self) -> int:
        """Grows by one whenever the granted tokens are replaced (a revocation may follow)."""
        return self._generation

    def may_use(self, principal: Principal, tenant: str) -> bool:
        """Whether a tenant ``principal`` may act for the chunks of ``tenant``: its own, or a
        shared space it is a member or owner of."""
        if principal.role is not Role.TENANT:
            return False
        if principal.tenant == tenant:
            return True
        access = self._spaces.get(tenant)
        return access is not None and (
            principal.tenant in access.members or principal.tenant in access.owners
        )

    def may_pin(self, principal: Principal, tenant: str) -> bool:
        """Whether ``principal`` may pin and warm ``tenant``'s chunks: an admin, or an owner
        of the shared space ``tenant``."""
        if principal.is_admin:
            return True
        access = self._spaces.get(tenant)
        return (
            principal.role is Role.TENANT
            and access is not None
            and (principal.tenant in access.owners)
        )

    def file_access(self, principal: Principal, owner: str) -> FileAccess | None:
        """How ``principal`` may map the chunk file of ``owner`` (an L1 account): None if not.

        An admin or an engine: any file, read-write. A tenant: its own file and the doctor's
        canary tenant's (:data:`~kvpool.common.keys.CANARY_TENANT`) read-write, a shared
        space's it :meth:`may_use` read-only (its stores into a space go through the agent's
        messages, which check them). An index or a gateway: none.
        """
        if principal.role in (Role.ADMIN, Role.ENGINE):
            return FileAccess.READ_WRITE
        if principal.role is not Role.TENANT:
            return None
        if owner in (principal.tenant, CANARY_TENANT):
            return FileAccess.READ_WRITE
        return FileAccess.READ_ONLY if self.may_use(principal, owner) else None

    @property
    def file_spaces(self) -> Mapping[str, SpaceAccess]:
        """The shared spaces the tokens file declares."""
        return self._own_spaces

    def replace_spaces(self, spaces: Mapping[str, SpaceAccess]) -> None:
        """Know exactly ``spaces`` beside the file's from now on (one assignment: a request
        sees the old set or the new one); a member left out may act for the space no more."""
        self._spaces = {**spaces, **self._own_spaces}

    def replace_granted(self, grants: Iterable[Grant]) -> list[Grant]:
        """Accept exactly ``grants`` beside the file's tokens from now on.

        A digest that the file (or an earlier grant of this call) gives another principal
        is refused, so that no token means two things; the refused grants are returned
        for the caller to report (by principal: never log a digest).
        """
        owners = {digest: principal for digest, principal in self._own}
        entries, refused = list(self._own), []
        for digest, principal in grants:
            owner = owners.get(digest)
            if owner is None:
                owners[digest] = principal
                entries.append((digest, principal))
            elif owner != principal:
                refused.append((digest, principal))
        self._entries, self._owners = entries, owners
        self._generation += 1
        return refused

    @property
    def token_count(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<TokenAuthority of {len(self._entries)} tokens>"

    def _token_list(self, value: object, where: str) -> list[str]:
        tokens = _token_list(value, where)
        for position, token in enumerate(tokens, start=1):
            if self._strong_only and (
                len(token) < MIN_TOKEN_CHARS or len(set(token)) < MIN_DISTINCT_CHARS
            ):
                raise TokenFileError(
                    f"{where}: token #{position} is too easy to guess ({len(token)} characters, "
                    f"{len(set(token))} different); a token needs {MIN_TOKEN_CHARS} characters "
                    f"or more, of {MIN_DISTINCT_CHARS} different ones at least: make one with "
                    "`openssl rand -hex 24`"
                )
        return tokens

    def _add(
        self, owners: dict[bytes, Principal], token: str, principal: Principal, where: str
    ) -> None:
        digest = digest_token(token)
        owner = owners.get(digest)
        if owner == principal:
            return  # listed twice for the same principal: harmless
        if owner is not None:
            raise TokenFileError(f"{where}: a token is also listed for {owner}; tokens must differ")
        owners[digest] = principal
        self._entries.append((digest, principal))


class GeneratedTokens:
    """A fresh random token for each key of ``files`` (``admin``, ``engines``, ``indexes``),
    kept until :meth:`write` puts each in its file (mode 0600), then forgotten.

    The authority is known at once; the files wait until the agent (or the index) has started
    everything else, so a failed start replaces no earlier agent's tokens. Each file is replaced
    atomically, so a reader never sees a partial token; a token generated at an earlier
    start stops working. Something at a file's path that is not a regular file of the
    agent's user is refused (:mod:`kvpool.common.files`).
    """

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = dict(files)
        self._tokens = {key: secrets.token_urlsafe(32) for key in files}
        self._source = ", ".join(str(path) for path in files.values())

    def authority(self) -> TokenAuthority:
        return TokenAuthority(self._tokens, source=self._source)

    def write(self, written: Callable[[Path], None] | None = None) -> None:
        """Write every file (checked first: one refused writes none); ``written`` hears of
        each file once it is in place."""
        for path in self.files.values():
            check_replaceable(path, "token file")
        for key, path in self.files.items():
            ensure_directory(path.parent, what="state directory")
            token = self._tokens[key]
            write_file(path, (token + "\n").encode(), TOKEN_FILE_MODE, what="token file")
            if written is not None:
                written(path)
        self._tokens.clear()
        where = ", ".join(f"{key} {path}" for key, path in self.files.items())
        log.info("no tokens file: generated tokens into %s (mode 0600)", where)


def load_authority(
    tokens_file: Path | None, generated: Mapping[str, Path]
) -> tuple[TokenAuthority, GeneratedTokens | None]:
    """An API's authority: from ``tokens_file`` if configured, else of fresh tokens for the
    files ``generated``, returned too, for the caller to write once it has started
    (:meth:`GeneratedTokens.write`): a failed start writes no token file."""
    if tokens_file is not None:
        return TokenAuthority.from_file(tokens_file), None
    tokens = GeneratedTokens(generated)
    return tokens.authority(), tokens


def _token_list(value: object, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise TokenFileError(
            f"{where}: expected a token or a list of tokens, got {type(value).__name__}"
        )
    tokens: list[str] = []
    for position, item in enumerate(items, start=1):
        if not isinstance(item, str):
            raise TokenFileError(
                f"{where}: token #{position} is a {type(item).__name__}, not a string"
            )
        if not _TOKEN.fullmatch(item):
            raise TokenFileError(
                f"{where}: token #{position} is empty or has whitespace or non-ASCII characters"
            )
        tokens.append(item)
    return tokens


def _spaces(value: object, source: str) -> dict[str, SpaceAccess]:
    """The tokens file's ``spaces``: tenant id -> members and owners (tenant ids)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TokenFileError(f"{source}: 'spaces' must map tenant ids to members and owners")
    found: dict[str, SpaceAccess] = {}
    for position, (space, entry) in enumerate(value.items(), start=1):
        if not isinstance(space, str) or not is_tenant_id(space):
            raise TokenFileError(
                f"{source}: space #{position} ({_glimpse(space)}): {TENANT_ID_RULE}"
            )
        where = f"{source}: space {space}"
        if not isinstance(entry, Mapping) or set(entry) - {"members", "owners"}:
            raise TokenFileError(f"{where}: expected a mapping with keys 'members', 'owners'")
        lists = []
        for key in ("members", "owners"):
            ids = entry.get(key) or []
            if not isinstance(ids, list) or not all(
                isinstance(item, str) and is_tenant_id(item) for item in ids
            ):
                raise TokenFileError(f"{where}: '{key}' must be a list of tenant ids")
            lists.append(frozenset(ids))
        found[space] = SpaceAccess(*lists)
    return found


def _glimpse(key: object) -> str:
    """A malformed key: quoted whole if it is too short to be a token a file may hold, else
    described but not quoted (it may be a token pasted in the wrong place)."""
    text = str(key)
    if len(text) < MIN_TOKEN_CHARS:
        return repr(text)
    return f"{text[:2]!r}... ({len(text)} characters)"


def _unknown_keys(keys: Sequence[object]) -> str:
    """``unknown key 'admn' (did you mean 'admins'?)``; keys named by :func:`_glimpse`."""
    named = ", ".join(_glimpse(key) for key in keys)
    if len(keys) > 1:
        return f"unknown keys {named}"
    text = str(keys[0])
    close = difflib.get_close_matches(text, [*_TOP_LEVEL_KEYS, *_OLD_KEYS], n=1)
    if not close or len(text) >= MIN_TOKEN_CHARS:
        return f"unknown key {named}"
    return f"unknown key {named} (did you mean '{_OLD_KEYS.get(close[0], close[0])}'?)"


def _renamed(tokens: Mapping[str, object], source: str) -> Mapping[str, object]:
    """``tokens`` with the keys of earlier releases under their names now, with a warning
    each; an old key beside its new name is refused (which did the writer mean?)."""
    old = [key for key in _OLD_KEYS if key in tokens]
    if not old:
        return tokens
    renamed = dict(tokens)
    for key in old:
        new = _OLD_KEYS[key]
        if new in renamed:
            raise TokenFileError(f"{source}: both '{key}' and '{new}' (its new name): keep '{new}'")
        log.warning("%s: the key '%s' is now '%s'; rename it (read as '%s')", source, key, new, new)
        renamed[new] = renamed.pop(key)
    return renamed


def _position(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return ""
    return f" (line {mark.line + 1}, column {mark.column + 1})"
