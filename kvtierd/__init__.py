"""kvtierd: a multi-tier KV-cache manager for LLM serving (EvicPress design)."""

__version__ = "0.1.0"
