"""Where each request goes, decided once per request before the exchange picks a path:
`decision` (remote, local or P alone, and why), `costmodel` (the lines it is fitted
from: prefill seconds, handoff, decode steps, tokens per character), `tickets` (the
prefills sent and not done, the last minute's decisions) and `routing`
(which P and which D: round robin, least outstanding, cache-aware)."""

from appliance.proxy.placement.decision import Decision, Estimates, Placement, decide
from appliance.proxy.placement.tickets import Ticket

__all__ = ["Decision", "Estimates", "Placement", "Ticket", "decide"]
