"""Where each request goes, decided once per request before the exchange picks a path:
`decision` (remote, local or P alone, and why), `costmodel` (the lines it is fitted
from: prefill seconds, handoff, D's step times, tokens per character) and `routing`
(which P and which D: round robin, least outstanding, cache-aware)."""

from appliance.proxy.placement.decision import Decision, Estimates, Placement, Ticket, decide

__all__ = ["Decision", "Estimates", "Placement", "Ticket", "decide"]
