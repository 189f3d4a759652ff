"""Benchmark entry point of a source checkout (the code lives in ``wyoming_cosyvoice3.bench``)."""
