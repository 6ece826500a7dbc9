"""Compatibility only: kvpool's code lives in :mod:`kvpool`. This package keeps
``kvpool_agent.connector``, the module path users' vLLM configurations name
(``kv_connector_module_path``), importable."""
