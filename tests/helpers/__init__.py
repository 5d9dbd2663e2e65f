"""Shared helpers of the GC, verify, crash and concurrency tests."""
