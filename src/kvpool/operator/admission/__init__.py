"""The operator's mutating admission webhook: one label wires a tenant's vLLM pod to its
pool.

A team labels its pod ``kvpool.io/cache-pool: <pool>``; on the pod's creation the API
server calls the operator, which finds the namespace's KVCacheTenant of that pool (kopf
indices, no API call) and answers with a JSON patch: the pool's CSI volume and mount (the
agent's door, read-only, for a tenant's pod; the pool's directory with its segment, and the
agents' supplemental group, for a pod of the pool's engineNamespaces) and the connector's
environment. It never refuses a pod: one it cannot wire is admitted as it is, with a
warning; and the webhook's failure policy is Ignore, so an operator that is down delays no
pod.

- :mod:`~kvpool.operator.admission.wiring`: the pure mutation (pod and facts in, patch and
  warnings out);
- :mod:`~kvpool.operator.admission.certificates`: the serving certificate and its CA;
- :mod:`~kvpool.operator.admission.server`: the webhook's bounded HTTPS server, reached by URL or
  through a Service;
- :mod:`~kvpool.operator.admission.handlers`: the kopf registrations, made when
  ``kvpool-operator`` is started with the webhook.

kopf keeps the MutatingWebhookConfiguration (``--webhook-configuration``, default
``kvpool-operator.kvpool.io``) itself: it creates it, and patches its webhook (client
configuration, caBundle, rules, ``objectSelector``) at start. The webhook is persistent: it
stays when the operator stops, so that a restarting operator's pods fall under the
Ignore policy rather than a configuration removed by the old process.
"""
