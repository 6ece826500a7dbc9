"""``kvpool-agent``: run one node agent."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

from kvpool import __version__
from kvpool.agent.server import Agent
from kvpool.agent.tenancy.quota_store import QuotaStoreError
from kvpool.agent.tenancy.tenants_watch import TenantsWatchError
from kvpool.common.auth import TokenFileError
from kvpool.common.config import AgentConfig, load_settings, setting
from kvpool.common.keyring import KeyringError
from kvpool.common.names import AGENT_CONFIG_FILE_ENV
from kvpool.common.problems import ArgumentParser, ConfigError, exit_with, start_logging
from kvpool.common.segment import SegmentError


def main(argv: Sequence[str] | None = None) -> int:
    prog = "kvpool-agent"
    parser = ArgumentParser(
        prog=prog,
        description=(
            "Run a kvpool node agent. Settings come from KVPOOL_* environment variables and "
            f"an optional YAML/JSON file (--config or {AGENT_CONFIG_FILE_ENV}); "
            "see docs/reference/settings.md."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", help="YAML or JSON file of agent settings")
    parser.add_log_level()
    args = parser.parse_args(argv)
    start_logging(args.log_level)
    if args.config:
        os.environ[AGENT_CONFIG_FILE_ENV] = args.config
    try:
        config = load_settings(AgentConfig)
    except ConfigError as error:
        return exit_with(prog, error)
    try:
        asyncio.run(Agent(config).run())
    except ConfigError as error:  # a port in use, a directory that cannot be made, ...
        return exit_with(prog, error)
    except TokenFileError as error:
        return exit_with(prog, _tokens_problem(config, error))
    except (SegmentError, QuotaStoreError, KeyringError, TenantsWatchError, OSError) as error:
        print(f"kvpool-agent: {error}", file=sys.stderr)
        return 1
    return 0


def _tokens_problem(config: AgentConfig, error: TokenFileError) -> ConfigError:
    """``error`` of the tokens file, after ``tokens_file`` as the user wrote it."""
    path = config.tokens_file
    if path is None:  # the generated tokens
        return ConfigError([f"invalid tokens file: {error}"])
    where = setting(AgentConfig, ("tokens_file",), path)
    return ConfigError([f"{where}: {str(error).removeprefix(f'{path}: ')}"])


if __name__ == "__main__":
    sys.exit(main())
