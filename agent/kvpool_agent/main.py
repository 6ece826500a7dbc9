"""``kvpool-agent``: run one node agent."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from kvpool_agent.config import AgentConfig
from kvpool_agent.l2.keyring import KeyringError
from kvpool_agent.names import AGENT_CONFIG_FILE_ENV
from kvpool_agent.segment import SegmentError
from kvpool_agent.server import Agent
from kvpool_agent.tenancy.auth import TokenFileError
from kvpool_agent.tenancy.quota_store import QuotaStoreError
from kvpool_agent.tenancy.tenants_watch import TenantsWatchError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpool-agent",
        description=(
            "Run a kvpool node agent. Settings come from KVPOOL_* environment variables and "
            f"an optional YAML/JSON file (--config or {AGENT_CONFIG_FILE_ENV}); see the README."
        ),
    )
    parser.add_argument("--config", help="YAML or JSON file of agent settings")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.config:
        os.environ[AGENT_CONFIG_FILE_ENV] = args.config
    try:
        config = AgentConfig()
    except (ValidationError, ValueError, OSError) as error:
        print(f"kvpool-agent: invalid configuration:\n{error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(Agent(config).run())
    except TokenFileError as error:
        print(f"kvpool-agent: invalid tokens file: {error}", file=sys.stderr)
        return 2
    except (SegmentError, QuotaStoreError, KeyringError, TenantsWatchError, OSError) as error:
        print(f"kvpool-agent: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
