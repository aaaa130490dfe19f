"""The proxy's P and D nodes: each one's state and load (`backends`), their health checks
(`health`), and on Kubernetes the pods behind them (`discovery`, `k8s_settings`)."""
