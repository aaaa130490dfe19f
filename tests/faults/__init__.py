"""Fault injection, out of the product: a fault plan (plan.py), a transport that fails or
delays writes by it (transport.py), and the connector real vLLM servers load to apply it
(connector.py, started through launch.py)."""
