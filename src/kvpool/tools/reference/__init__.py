"""The reference pages of the documentation site (``docs/reference/``), generated from the
code: the settings from the configuration models, the CRD fields from the spec models, the
HTTP APIs from their OpenAPI schemas, the ZMQ messages from :mod:`kvpool.common.protocol`,
the metrics from the processes' registries, and every command's ``--help``.

    python -m kvpool.tools.reference          # rewrites the pages under docs/
    python -m kvpool.tools.reference --check  # exits 1, naming each page that differs

The pages are committed (readable on GitHub and in a diff), and
``tests/docs/test_reference.py`` runs the check, so a change to a model, a route, a message,
a metric or a help text that leaves its page stale fails the suite.
"""
