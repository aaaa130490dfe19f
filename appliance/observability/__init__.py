"""What an SRE watches a node with: the Grafana dashboard, built from code, beside the
Prometheus scrape config and alert rules in config/prometheus/."""
