"""Benchmarks that drive dpserve from the outside.

`serve.py` is the load generator behind `dpserve bench serve`: it sends a fixed
number of streaming requests at a fixed concurrency to any OpenAI-compatible
server and reports latency (TTFT, ITL, end-to-end) and throughput. Modules here
import nothing heavy (no torch); import the one you need.
"""
