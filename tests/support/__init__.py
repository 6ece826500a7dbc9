"""What the tests of several folders (and the e2e) share; no test module is imported.

- :mod:`~tests.support.kube_api`: the Kubernetes API server emulator (served over HTTP);
- :mod:`~tests.support.crd_schema`: the CRDs' schemas applied as an API server applies
  them (defaults, OpenAPI validation, CEL rules);
- :mod:`~tests.support.operator_process`: kubectl against it, a real ``kvpool-operator``;
- :mod:`~tests.support.tools`: kubectl and helm from their PyPI package;
- :mod:`~tests.support.engines`, :mod:`~tests.support.engine_main`,
  :mod:`~tests.support.greedy`: real vLLM CPU engines and greedy output compared up to noise;
- :mod:`~tests.support.index_process`: a real ``kvpool-index`` with the tests' tokens;
- :mod:`~tests.support.raw_http`, :mod:`~tests.support.raw_zmq`: HTTP and the agent's ZMQ
  protocol spoken by hand (for what well-behaved clients never send);
- :mod:`~tests.support.l1`: in-process L1 caches and services, and a clock to move;
- :mod:`~tests.support.chunks`, :mod:`~tests.support.metrics`,
  :mod:`~tests.support.polling`, :mod:`~tests.support.ports`: keys and bytes, one agent
  metric, bounded waiting, free loopback ports.

Real agent processes: :mod:`~tests.support.agent_process`, the benches' agent
(:mod:`kvpool.tools.bench.local.agent_process`) with what only tests ask of it; hosts in
network namespaces (root only; :mod:`kvpool.tools.bench.local.hosts`), or the test skipped:
:mod:`~tests.support.hosts`. Server processes with health checks, vLLM's OpenAI server and
peers' settings are the benches' too (:mod:`kvpool.tools.bench.local`).
"""
