"""Real processes for the tests and for ``kvpool bench``: an agent, a local S3 server.

Shipped with the package because the benchmarks are (``kvpool bench service`` starts an
agent, ``kvpool bench l2`` an S3 server); the tests import them from here.
"""
