"""The import contracts (pyproject's ``[tool.importlinter]``, run by ``make lint``) stay whole.

"Nothing but the CLI imports the benchmarks" names its source modules one by one (a
forbidden contract cannot take "every module but these"); a module added later and not
listed would escape it, so this holds the list to the package's modules.
"""

import pkgutil
import tomllib
from pathlib import Path

import kvpool_agent

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
BENCH_CONTRACT = "Nothing but the CLI imports the benchmarks"


def test_every_module_but_the_cli_and_the_benches_is_held_to_the_bench_contract() -> None:
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == BENCH_CONTRACT]
    top_level = {
        f"kvpool_agent.{module.name}" for module in pkgutil.iter_modules(kvpool_agent.__path__)
    }
    expected = top_level - {"kvpool_agent.bench", "kvpool_agent.cli"} | {"kvpool_operator"}
    assert set(contract["source_modules"]) == expected
