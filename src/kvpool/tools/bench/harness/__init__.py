"""The benchmarks' harness (``pip install 'kvpool[bench]'``), which the tests use too: an
agent process, a local S3 server, hosts in network namespaces (root only), tiny models.
No component imports it (the import contracts say so).

Shipped with the package because the benchmarks are (``kvpool bench service`` starts an
agent, ``kvpool bench l2`` an S3 server); the tests import them from here.
"""
