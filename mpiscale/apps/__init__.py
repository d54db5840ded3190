"""Workloads built on the runtime."""
