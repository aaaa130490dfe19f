"""Where each request goes, decided once per request before the exchange picks a path:
`rule` (remote, local or P alone, and why: pure), `decision` (the measurements the rule
weighs, per request), `costmodel` (the lines they are fitted from: prefill seconds,
handoff, decode steps, tokens per character), `priors` and `seeding` (what they start
from: P's history, or a calibration), `tickets` (the prefills sent and not done, the last
minute's decisions) and `routing` (which P and which D: round robin, least outstanding,
cache-aware)."""

from appliance.proxy.placement.decision import Placement
from appliance.proxy.placement.rule import Decision, Estimates, decide
from appliance.proxy.placement.tickets import Ticket

__all__ = ["Decision", "Estimates", "Placement", "Ticket", "decide"]
