"""The Kubernetes custom metrics API (custom.metrics.k8s.io) for Triptych's autoscaling.

An aggregated API server, run as `triptych-metrics-api`: it scrapes each DiffusionPipeline's
head `/metrics` and serves the per-role gauges as Object metrics on the role's Deployment, which
the HPA the operator creates reads. See docs/autoscaling.md.
"""
