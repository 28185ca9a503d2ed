"""Benchmarks that print figures: ingest, lookup, generate and accept, with one results format."""
