"""kvpool's node agent, its client library and vLLM connector, the prefix index and the tools.

The root holds the process entry points and the contracts the parts share; every other
part is a package, and each package imports only from the ones listed after it (the
layers, checked by ``make lint``; ``docs/architecture.md`` draws them).

Entry points:

* ``cli`` -- ``kvpool``: tenant ids, ``doctor``, ``index``, ``bench``;
* ``scripts`` -- the console scripts of the extras, and the one-line "install the extra";
* ``main`` -- ``kvpool-agent``: arguments, configuration errors, exit codes;
* ``server`` -- the agent's composition root: builds every part, starts and stops them.

Packages, from the top down:

* ``bench`` -- ``kvpool bench NAME``, one module per benchmark;
* ``doctor`` -- ``kvpool doctor``, one module per check; ``testing`` -- process harnesses;
* ``edge`` -- the agent's ZMQ server, HTTP API, chunk events and metrics;
  ``index`` -- the pool-wide prefix index (a process of its own);
* ``tiering`` -- write-back to and prefetch from L2;
* ``l2`` -- the NVMe and S3 tiers, the sealed object codec and its keys;
* ``service`` -- the one seam through which every edge and controller reaches the cache;
* ``web`` -- HTTP plumbing shared by the agent and the index;
* ``tenancy`` -- bearer tokens, quota stores, the KVCacheTenants' tokens and ceilings;
* ``core`` -- the L1 cache over the shared segment (no I/O library at all);
* ``kube`` -- Kubernetes list+watch;
* ``connector`` -- the vLLM KV connector (users' vLLM configurations name this path);
* ``client`` -- the agent's client library (this path too is public).

Contracts (what the agent shares with the connector, the operator, the doctor, the index):

* ``config`` -- the agent's settings (the operator renders them);
* ``api_models`` -- the HTTP API's bodies; ``tenants_configmap`` -- the tenants
  ConfigMap's codec;
* ``quotas`` -- quota values and their stored forms;
* ``protocol`` -- the ZMQ messages and the chunk events; ``segment`` -- the shared-memory
  segment's layout; ``probe_table`` -- the lock-free lookup table beside it; ``pinned`` --
  pinning a mapping of it for CUDA copies;
* ``names`` -- labels, annotations, variables, ports, policy names; ``keys`` -- chunk keys
  and tenant ids; ``files`` -- creating and adopting the agent's own files and directories
  (exclusively, with exact modes, nothing another local user planted).
"""

__version__ = "0.1.0"
