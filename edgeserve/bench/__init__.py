"""Benchmark workloads for the in-process engine and the HTTP driver for any OpenAI-compatible server."""
