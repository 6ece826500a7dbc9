"""``kvpool doctor``: a deployment checked end to end, the way a vLLM pod's connector sees it.

A silent zero-hit deployment is what users report most; each check names one way to get
there, and its fix. Modules, one check (or family) each:

* ``address`` -- service, protocol, annotations: the pool's Service, read as the
  connector reads it (its own discovery), with this pod's credentials;
* ``agent`` -- the agent answers hello at that address (and if not, why);
* ``shared_memory`` -- segment, shm: this pod maps the agent's segment read-write, on a
  /dev/shm that holds it (else a WARN: KV then travels through the agent's messages);
* ``transport`` -- which of the two the connector here would use;
* ``canary`` -- a chunk through the agent and the mapped segment (or the agent's messages)
  both ways, compared byte for byte, then cleared;
* ``chunk_size``, ``fingerprint`` -- chunks of whole vLLM blocks; the index hashes
  prompts as the connector does;
* ``hit_rate`` -- no tenant keeps missing (the agent's counters, admin token);
* ``peers`` -- the agent reaches each of its peers (the pool's other agents) and both
  prove the pool's credential (admin token);
* ``model`` -- what kvpool caches of each kind of layer of the model (its config.json
  alone, no agent);
* ``run`` the order and the skips, ``report`` the lines, ``command`` the command line;
  ``kube`` the Kubernetes reads, ``agent_http`` the admin reads of the agent's HTTP API.
"""
