#!/usr/bin/env bash
# One GPU host: kvtierd daemon, vLLM with LMCache + the kvtierd plugin, kvtierd router in front
# (docs/integration.md). GPU pins (not installed by the CPU extra): vllm==0.32.0 (CUDA build),
# lmcache==0.5.6. Runs until one of the three exits or Ctrl-C, then stops the others.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct MAX_MODEL_LEN=32768 configs/gpu-deployment/serve.sh
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-32768}
HERE=$(cd "$(dirname "$0")" && pwd)
SOCKET=/run/kvtierd/kvtierd.sock  # kvtierd.yaml's socket_path = lmcache.yaml's kvtierd.socket_path
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT

kvtierd serve --config "$HERE/kvtierd.yaml" &
# The plugin connects to the daemon when vLLM starts; without it LMCache runs with no cache.
until kvtierctl --socket "$SOCKET" status >/dev/null 2>&1; do sleep 1; done

# The api_server module is `vllm serve` on every build (the CPU build has no `vllm serve`:
# PackageNotFoundError), so the docs use one form. vLLM's prefix cache stays on: kvtierd serves
# what it has dropped (docs/integration.md, "Why --no-enable-prefix-caching").
LMCACHE_CONFIG_FILE="$HERE/lmcache.yaml" LMCACHE_TRACK_USAGE=false \
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port 8000 \
  --max-model-len "$MAX_MODEL_LEN" --enable-prompt-tokens-details \
  --kv-transfer-config '{"kv_connector": "KvtierLMCacheConnectorV1",
    "kv_connector_module_path": "kvtierd.integrations.cpu_connector", "kv_role": "kv_both"}' &

# The OpenAI-compatible router in front of vLLM (`kvtierd router`, kvtierd/main.py).
kvtierd router --upstream http://127.0.0.1:8000 --socket "$SOCKET" --port 8100 --chunk-size 256 &
wait -n
