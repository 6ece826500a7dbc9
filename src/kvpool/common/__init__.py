"""The contracts every part of kvpool shares: the agent, the connector, the client, the
index, the CSI plugin, the operator and the tools all import from here, and this package
imports none of them. Not an API for programs outside kvpool (docs/architecture.md,
"Public surfaces").

* ``config`` -- the agent's settings (the operator renders them); ``index_config`` and
  ``routing`` -- the prefix index's settings and routing policy (the operator renders them);
* ``web`` -- the bounded HTTP plumbing of the agent, the index and the operator's webhook;
* ``auth`` -- bearer tokens and what each may do (the agent's and the index's);
  ``keyring`` and ``handshake`` -- the pool's peer keys and the handshake they prove;
* ``api_models`` -- the HTTP API's bodies; ``tenants_configmap`` -- the tenants ConfigMap's
  codec; ``quotas`` -- quota values and their stored forms;
* ``protocol`` -- the ZMQ messages and the chunk events; ``segment`` -- the shared-memory
  segment's layout; ``chunk_files`` -- the chunk files; ``probe_table`` -- the lock-free
  lookup table beside the segment; ``door`` -- the door's wire format;
* ``kube`` -- Kubernetes list+watch and the agents' discovery;
* ``names`` -- labels, annotations, variables, ports, policy names; ``keys`` -- chunk keys
  and tenant ids; ``files`` -- the agent's own files, created and adopted safely;
  ``sizes``; ``problems`` -- a refused configuration in one line; ``extras`` -- whether a
  part's extra is installed.
"""
