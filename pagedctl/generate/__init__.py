"""Batch jobs: reading inputs, running them on the engine, writing durable results."""
