"""``kvpool``, the tools for operators and tenants, above every component:

* ``cli`` -- ``kvpool``: ``tenant-id``, ``doctor``, ``bench``;
* ``doctor`` -- ``kvpool doctor``, one module per check;
* ``bench`` -- ``kvpool bench NAME`` (``pip install 'kvpool[bench]'``), one module per
  benchmark, and ``bench.harness``, the processes they start (an agent, an S3 server,
  network-namespace hosts, tiny models), which the tests use too;
* ``reference`` -- the docs' reference pages (settings, CRDs, APIs, metrics, commands).
"""
