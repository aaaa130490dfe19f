"""What an SRE watches a node with: traces (OpenTelemetry: `tracing`), and the Grafana
dashboard, built from code, beside the Prometheus scrape config and alert rules in
config/prometheus/."""
