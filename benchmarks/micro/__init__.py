"""Micro-benchmarks: one part of kvtierd (daemon, tiers, placer, kernels, executor, profiler)
measured against a physical limit or a baseline run in the same process (DESIGN.md section 4)."""
