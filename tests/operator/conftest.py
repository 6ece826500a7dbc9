"""The operator tests' cluster: one emulated API server and one ``kvpool-operator`` for the
whole folder (package scope: both stop after its last test), and namespaces of each test's
own, so that the tests stay independent of each other.

The operator serves every namespace, with the options that every module's tests need:

- ``--usage-seconds 1``: a tenant's re-check, a pool's shared spaces pass and its peer key
  rotation check run every second (test_tenants, test_spaces, test_peers wait for them);
  a test that waits for none of these passes waits for what it waited for before;
- ``--clear-retries 1``: a deleted tenant's clearing is retried once while its agents fail
  (only tenants are deleted with agents down);
- ``--verbose``: kopf's debug records, among them its word that a daemon stopped
  (test_peers); the tests that read the log read their own objects' records;
- the admission webhook on 127.0.0.1 (test_webhook): it is only called for pods labelled
  ``kvpool.io/cache-pool``, which no other test makes.

A test that stops the operator leaves it stopped: the next test that asks for it (the
``operator`` fixture) starts it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.operator.shared_operator import running, unique
from tests.support.kube_api import ServedApi
from tests.support.operator_process import REPO, Kubectl, OperatorProcess
from tests.support.ports import free_port


@pytest.fixture(scope="package")
def served_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    api = ServedApi(tmp_path_factory.mktemp("api")).start()
    yield api
    api.stop()


@pytest.fixture(scope="package")
def kubectl(served_api: ServedApi) -> Kubectl:
    return Kubectl(served_api.kubeconfig())


@pytest.fixture(scope="package")
def operator_process(
    served_api: ServedApi, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator every test of the folder shares (see the module's docstring); use the
    ``operator`` fixture, or :func:`running` in a fixture of a wider scope."""
    kubectl("apply", "--validate=false", "-f", str(REPO / "crds"))
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    options = (
        "--usage-seconds",
        "1",
        "--clear-retries",
        "1",
        "--verbose",
        "--webhook-url-host",
        "127.0.0.1",
        "--webhook-bind",
        "127.0.0.1",
        "--webhook-port",
        str(free_port()),
    )
    process = OperatorProcess(served_api.kubeconfig(), None, log, options)
    yield running(process, served_api)
    process.stop()


@pytest.fixture
def operator(operator_process: OperatorProcess, served_api: ServedApi) -> OperatorProcess:
    """The shared operator, running."""
    return running(operator_process, served_api)


@pytest.fixture
def namespaces(served_api: ServedApi) -> Iterator[Callable[[str], str]]:
    """This test's namespace names: ``namespaces("team-a")`` is ``team-a-<n>``, unique to it.
    Each is removed after the test, with everything in it (the operator's daemons of its
    pools and tenants stop: they would run on, every second, through the later tests)."""
    given: list[str] = []

    def name(base: str) -> str:
        given.append(unique(base))
        return given[-1]

    yield name
    for namespace in given:
        served_api.remove_namespace(namespace)
