"""End-to-end: the whole kvpool flow on one machine (see ``scenario.py``)."""
