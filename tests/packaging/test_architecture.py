"""The architecture diagram in docs/architecture.md is the one the import contracts draw."""

from __future__ import annotations

from tests.support.architecture import DOC, block, contracts, diagram


def test_the_committed_diagram_agrees_with_the_contracts() -> None:
    assert block(DOC.read_text()) == diagram(contracts()), (
        "run: python -m tests.support.architecture --write"
    )


def test_every_component_is_drawn_apart() -> None:
    drawn = diagram(contracts())
    for component in ("agent", "index", "csi", "operator", "connector", "client", "common"):
        assert f'm_kvpool_{component}["{component}"]' in drawn
    (independence,) = [c for c in contracts() if c["type"] == "independence"]
    assert set(independence["modules"]) >= {
        "kvpool.agent",
        "kvpool.index",
        "kvpool.csi",
        "kvpool.operator",
        "kvpool.connector",
    }
