"""Benchmarks that print figures: ingest, lookup, generate, accept, learn and learn-loop, with one results format."""
