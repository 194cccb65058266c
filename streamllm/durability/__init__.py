"""Durability: the ingest log, recovery from it, and session snapshots."""
