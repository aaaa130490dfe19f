"""The KV connector. vLLM loads `PDConnector` from `appliance.connector.facade` (its
`kv_connector_module_path`); importing this package loads nothing else, so the parts vLLM
need not be present for (`cpu_features`, vLLM's general plugin in every process of this
environment; what tests/gpu imports) stay free of vLLM. The proxy imports nothing here:
the side channel's messages and CURVE are `appliance.sidechannel`."""
