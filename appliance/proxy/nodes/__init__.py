"""The proxy's P and D nodes: each one's state and load (`backends`), their health checks
(`health`), and on Kubernetes the pods behind them (`discovery`; its settings are
`appliance.proxy.k8s_settings`, a part of the proxy's settings)."""
