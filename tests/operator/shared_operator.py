"""The operator that the operator tests share, and the names that keep their namespaces
apart (the fixtures are in ``conftest.py``)."""

from __future__ import annotations

import itertools

from tests.support.kube_api import ServedApi
from tests.support.operator_process import OperatorProcess
from tests.support.polling import eventually

CONFIGURATION = "kvpool-operator.kvpool.io"
"""The operator's MutatingWebhookConfiguration (cluster-scoped: the only one)."""

_numbers = itertools.count(1)


def unique(base: str) -> str:
    """``base`` with a number no other name of this run has (``inference`` -> ``inference-7``):
    the namespaces of one test (or one module's fixture) are theirs alone."""
    return f"{base}-{next(_numbers)}"


def running(process: OperatorProcess, api: ServedApi) -> OperatorProcess:
    """The operator, started if it is not running (a test before stopped it), once it has
    configured its webhook."""
    if not process.running:
        process.start()

    def configured() -> None:
        configuration = api.objects("mutatingwebhookconfigurations").get(CONFIGURATION)
        assert configuration and configuration.get("webhooks"), configuration

    eventually(configured, timeout=30, what=process.log(process.startup[0]))
    return process
