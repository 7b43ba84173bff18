"""End-to-end benchmarks: the daemon under vLLM + LMCache on a trace, the matrix of runs
behind the README's headline, and the simulator's projection of them."""
