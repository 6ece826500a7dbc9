"""The decode pod's sidecar of prefill/decode disaggregation (``kvpool-pd-sidecar``).

It listens on the port the InferencePool targets, in front of the pod's vLLM OpenAI
server. When the endpoint picker disaggregates a request, Envoy sends it here with the
picker's signed choice of a prefill pod (:data:`kvpool.common.disagg.PREFILL_HEADER`): the
sidecar has that pod compute the prompt's KV (one token, stored in kvpool and offered to
this node), then has the local vLLM decode with kvpool's decode params, which make its
connector wait for and load those chunks. Everything else is proxied unchanged.

* :mod:`~kvpool.sidecar.main`: flags, the start's checks, serving until SIGTERM;
* :mod:`~kvpool.sidecar.proxy`: the ASGI app: which requests it disaggregates, the result
  header, a client's disconnect cancelling what it waits for;
* :mod:`~kvpool.sidecar.prefill`: the prefill pod a request names, and its request there;
* :mod:`~kvpool.sidecar.relay`: one request to an upstream, its answer streamed back;
* :mod:`~kvpool.sidecar.bodies`: the prefill's and the decode's JSON bodies (no I/O);
* :mod:`~kvpool.sidecar.settings`: what the flags decide.
"""
