#!/usr/bin/env bash
# One GPU host: kvtierd daemon, vLLM with LMCache + the kvtierd plugin, kvtierd router in front.
# GPU pins (documented, not installed by the CPU extra): vllm==0.32.0 (CUDA build), lmcache==0.5.6.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
HERE=$(cd "$(dirname "$0")" && pwd)

kvtierd serve --config "$HERE/kvtierd.yaml" &

LMCACHE_CONFIG_FILE="$HERE/lmcache.yaml" LMCACHE_TRACK_USAGE=false \
vllm serve "$MODEL" --port 8000 \
  --kv-transfer-config '{"kv_connector":"KvtierLMCacheConnectorV1",
    "kv_connector_module_path":"kvtierd.integrations.cpu_connector","kv_role":"kv_both"}' &

# The OpenAI-compatible router in front of vLLM (`kvtierd router`, kvtierd/main.py).
kvtierd router --upstream http://127.0.0.1:8000 --socket /run/kvtierd/kvtierd.sock \
  --port 8100 --chunk-size 256
