"""Grafana dashboards declared as code, and their provisioning."""
