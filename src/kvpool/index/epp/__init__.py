"""The endpoint picker's edge: Envoy's external-processing gRPC service (a Gateway API
Inference Extension endpoint picker) in front of a :class:`~kvpool.index.picking.Picker`.

:mod:`.server` serves it, :mod:`.stream` answers one HTTP request's stream of messages,
:mod:`.bodies` reads what to pick from an OpenAI body, :mod:`.answers` builds the replies,
:mod:`.prefill` the prefill headers of prefill/decode disaggregation.
"""

from kvpool.index.epp.server import EppServer
from kvpool.index.epp.stream import Answers

__all__ = ["Answers", "EppServer"]
