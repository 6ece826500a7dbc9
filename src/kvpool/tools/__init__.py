"""``kvpool``, the tools for operators and tenants, above every component:

* ``cli`` -- ``kvpool``: ``tenant-id``, ``doctor``, ``bench``;
* ``doctor`` -- ``kvpool doctor``, one module per check;
* ``bench`` -- ``kvpool bench NAME`` (``pip install 'kvpool[bench]'``), one module per
  benchmark, and ``bench.local``, what they run on this machine (an agent, an S3 server,
  tiny models), which the tests build on;
* ``reference`` -- the docs' reference pages (settings, CRDs, APIs, metrics, commands).
"""
