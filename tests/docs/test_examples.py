"""Every code block of the documentation (and the README) is run or checked, by language:

- ``python``: executed; marked ``agent``, against a real agent of its own (its ``ENDPOINT``
  and ``TOKEN`` lines replaced by that agent's);
- ``sh``: ``bash -n``, and every command it runs is one the docs know;
- ``yaml``: parsed; a Kubernetes object validated against kvpool's CRDs (schema and CEL
  rules, as an API server applies them) or, for Kubernetes' own kinds, with
  ``kubernetes-validate``; ``pool-fragment``, ``agent-config`` and ``tokens-file`` blocks as
  what they are.

A block marked ``skip (reason)`` is not run; every other block of those languages must be
one of the kinds above. ``text``, ``dockerfile``, ``mermaid`` and blocks without a language
are output and pictures.
"""

from __future__ import annotations

import copy
import re
import secrets
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool.common.auth import TokenAuthority
from kvpool.common.config import AgentConfig
from kvpool.common.keys import tenant_id
from tests.docs.examples import DOCUMENTS, ROOT, Example, all_examples, examples
from tests.support.agent_process import ENGINE_TOKEN, AgentProcess
from tests.support.crd_schema import (
    CRD_PATH,
    GAIE_CRD_PATH,
    OLDEST_KUBERNETES,
    TENANT_CRD_PATH,
    object_errors,
    rule_errors,
    schema,
    schema_errors,
    with_defaults,
)

PYTHON = all_examples("python")
SHELL = all_examples("sh")
YAML = all_examples("yaml")
LANGUAGES = {"python", "sh", "yaml", "text", "dockerfile", "mermaid", ""}
KNOWN_COMMANDS = {
    # kvpool's own
    "kvpool", "kvpool-agent", "kvpool-operator", "kvpool-csi", "make", "python", "python3",
    ".venv/bin/python", ".venv/bin/pytest", ".venv/bin/mkdocs", "pip",
    # the cluster and the image
    "kubectl", "helm", "docker", "kind",
    # the shell's and the usual tools
    "curl", "openssl", "printf", "cat", "base64", "jq", "export", ".", "source",
}  # fmt: skip
CRDS = {"KVCachePool": CRD_PATH, "KVCacheTenant": TENANT_CRD_PATH}
INFERENCE_POOLS = "inference.networking.k8s.io/v1"
"""The Gateway API Inference Extension's InferencePools, checked against its CRD."""
BASE_POOL = ROOT / "e2e" / "manifests" / "pool.yaml"
"""The pool a ``pool-fragment`` block is merged over."""


def _id(example: Example) -> str:
    return example.where


def test_every_block_is_of_a_known_language_and_marker() -> None:
    for path in DOCUMENTS:
        for example in examples(path):
            assert example.language in LANGUAGES, f"{example.where}: ```{example.language}"
            known = {"", "agent", "agent-config", "tokens-file", "pool-fragment"}
            assert example.marker in known or example.skipped, (
                f"{example.where}: marker {example.marker!r}; a skip needs a reason: skip (why)"
            )


def _skip(example: Example) -> None:
    if example.skipped:
        pytest.skip(f"{example.where}: {example.skipped}")


# ---------------------------------------------------------------- python


@pytest.mark.parametrize("example", [e for e in PYTHON if e.marker != "agent"], ids=_id)
def test_python_example_runs(example: Example) -> None:
    _skip(example)
    compiled = compile(example.code, example.where, "exec")
    exec(compiled, {"__name__": "__docs__"})


@pytest.mark.process
@pytest.mark.parametrize("example", [e for e in PYTHON if e.marker == "agent"], ids=_id)
def test_python_example_runs_against_an_agent(
    example: Example, agent_process: AgentProcess
) -> None:
    agent = agent_process.start()
    code, endpoints = re.subn(
        r'^ENDPOINT = ".*"$', f"ENDPOINT = {agent.zmq!r}", example.code, flags=re.M
    )
    code, tokens = re.subn(r"^TOKEN = .*$", f"TOKEN = {ENGINE_TOKEN!r}", code, flags=re.M)
    assert (endpoints, tokens) == (1, 1), f"{example.where} names its endpoint and token otherwise"
    exec(compile(code, example.where, "exec"), {"__name__": "__docs__"})


def test_the_python_examples_are_found() -> None:
    assert any(example.marker == "agent" for example in PYTHON)


# ---------------------------------------------------------------- sh


def _commands(code: str) -> list[str]:
    """The first word of every simple command of ``code`` (after variable assignments);
    quoted text is no command, but a ``$(...)`` inside double quotes is."""
    code = re.sub(r"'[^']*'", " Q ", code)
    code = re.sub(
        r'"((?:[^"\\]|\\.)*)"',
        lambda quoted: (
            " ".join(f"; {inner}" for inner in re.findall(r"\$\(([^)]*)\)", quoted[1])) or " Q "
        ),
        code,
    )
    code = re.sub(r"\\\n", " ", code)
    found = []
    for line in code.splitlines():
        command = re.sub(r"(^|\s)#.*$", "", line)
        for part in re.split(r"&&|\|\||[;|&]|\$\(", command):
            words = [w for w in part.replace(")", " ").split() if not re.fullmatch(r"\w+=.*", w)]
            if words:
                found.append(words[0])
    return found


@pytest.mark.process
@pytest.mark.parametrize("example", SHELL, ids=_id)
def test_shell_example_parses_and_runs_known_commands(example: Example) -> None:
    _skip(example)
    done = subprocess.run(
        ["bash", "-n"], input=example.code, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{example.where}: {done.stderr}"
    unknown = [command for command in _commands(example.code) if command not in KNOWN_COMMANDS]
    assert unknown == [], f"{example.where}: commands the docs do not know: {unknown}"


def test_the_make_targets_of_the_docs_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for example in SHELL:
        for target in re.findall(r"(?:^|&& )make ([\w-]+)", example.code, re.M):
            assert target in targets, f"{example.where}: make {target}"


# ---------------------------------------------------------------- yaml


def _placeholders(text: str) -> str:
    """Placeholders of the docs, replaced by values of their kind."""
    text = text.replace("<tenant id>", tenant_id("docs-tenant"))
    text = re.sub(r"<[^<>]*token>", lambda _: secrets.token_hex(24), text)
    return text.replace("<pool>", "main")


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = _merge(base.get(key), value)
        return merged
    return copy.deepcopy(over)


def _resource_errors(document: dict[str, Any]) -> list[str]:
    path = CRDS.get(document.get("kind", ""))
    if document.get("apiVersion", "").startswith("kvpool.io/") and path is not None:
        defaulted = with_defaults(schema(path), document)
        return schema_errors(defaulted, path) + rule_errors(defaulted, path)
    if document.get("apiVersion") == INFERENCE_POOLS:
        return object_errors(schema(GAIE_CRD_PATH), document)
    try:
        kubernetes_validate.validate(document, OLDEST_KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [str(error)]
    return []


@pytest.mark.parametrize("example", YAML, ids=_id)
def test_yaml_example_is_valid(example: Example) -> None:
    _skip(example)
    documents = [d for d in yaml.safe_load_all(_placeholders(example.code)) if d is not None]
    assert documents, f"{example.where}: empty"
    for document in documents:
        if example.marker == "pool-fragment":
            base = yaml.safe_load(BASE_POOL.read_text())
            assert _resource_errors(_merge(base, document)) == [], example.where
        elif example.marker == "agent-config":
            AgentConfig.model_validate(document)
        elif example.marker == "tokens-file":
            TokenAuthority(document, source=example.where)
        else:
            assert "apiVersion" in document and "kind" in document, (
                f"{example.where}: not a Kubernetes object: mark it (pool-fragment, "
                "agent-config, tokens-file) or skip it with a reason"
            )
            assert _resource_errors(document) == [], example.where


# ---------------------------------------------------------------- the checks themselves


def test_the_checks_catch_mistakes() -> None:
    assert _commands("kubectl get kvp && frobnicate --now | jq .x") == [
        "kubectl",
        "frobnicate",
        "jq",
    ]
    assert _commands('X=1 curl -H "Bearer $(cat token)" host') == ["curl", "cat"]
    tenant = yaml.safe_load(
        "apiVersion: kvpool.io/v1alpha1\nkind: KVCacheTenant\nmetadata: {name: t, namespace: n}\n"
        "spec: {poolRef: {name: main, namespace: inference}, quota: {l1: 8Gi, sise: 1}}"
    )
    assert _resource_errors(tenant) != []
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containerz": []}}
    assert _resource_errors(pod) != []
    fragment = _merge(yaml.safe_load(BASE_POOL.read_text()), {"spec": {"l1": {"sise": "1Gi"}}})
    assert _resource_errors(fragment) != []
