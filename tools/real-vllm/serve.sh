#!/usr/bin/env bash
# Start vLLM (CPU) on 127.0.0.1:PORT serving DEST/model (built by setup.sh), wait until
# GET /v1/models answers, and print the server's PID. See README.md beside this file.
#
#   pid=$(bash tools/real-vllm/serve.sh DEST PORT)   # progress on stderr, the PID on stdout
#   ...                                              # OpenAI base URL: http://127.0.0.1:PORT/v1
#   kill -- -"$pid"                                  # stops the server and its engine
#
# The server runs in its own session (process group), so `kill -- -"$pid"` ends every
# child. Its log is DEST/logs/vllm-PORT.log, its PID also in DEST/logs/vllm-PORT.pid.
# A server already answering on PORT from an earlier run of this script is reused.
#
# Environment (all optional):
#   SERVED_MODEL_NAME       model name clients send (default gemma3-270m)
#   MAX_MODEL_LEN           context length, prompt + completion (default 4096)
#   VLLM_DTYPE              bfloat16 (default) or float32
#   VLLM_CPU_KVCACHE_SPACE  GiB of KV cache (default 1: 81,621 tokens, ~20 full 4096 contexts)
#   STARTUP_TIMEOUT         seconds to wait for /v1/models (default 900)
#   VLLM_SKIP_WARMUP=1      skip the warm-up request (the first request that asks for
#                           logprobs after startup takes ~4 s more, once; serve.sh sends a
#                           2-token one before printing the PID)
#   VLLM_NO_PRELOAD=1       do not preload the venv's Intel OpenMP (libiomp5.so, from the
#                           intel-openmp package vllm-cpu depends on); preloading it is what
#                           vLLM's CPU docs advise, and measured ~20% faster decoding here
#   VLLM_EXTRA_ARGS         more arguments for vLLM's OpenAI server, split on spaces
set -euo pipefail

if [ $# -ne 2 ] || [ -z "$1" ] || ! [[ "$2" =~ ^[0-9]+$ ]]; then
    echo "usage: $0 DEST PORT" >&2
    exit 64
fi
DEST="$(cd "$1" && pwd)"
PORT="$2"
PY="$DEST/venv/bin/python"
MODEL="$DEST/model"
NAME="${SERVED_MODEL_NAME:-gemma3-270m}"
LOGS="$DEST/logs"
LOG="$LOGS/vllm-$PORT.log"
PIDFILE="$LOGS/vllm-$PORT.pid"
URL="http://127.0.0.1:$PORT/v1/models"
TIMEOUT="${STARTUP_TIMEOUT:-900}"

if [ ! -x "$PY" ] || [ ! -f "$MODEL/config.json" ]; then
    echo "serve.sh: $DEST is not set up; run: bash tools/real-vllm/setup.sh $1" >&2
    exit 1
fi

answers() {
    if command -v curl >/dev/null 2>&1; then
        curl -sf -m 5 "$URL" >/dev/null 2>&1
    else
        "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
            "$URL" >/dev/null 2>&1
    fi
}

warm_up() {
    "$PY" - "http://127.0.0.1:$PORT/v1/chat/completions" "$NAME" <<'PYEOF'
import json, sys, urllib.request
body = {"model": sys.argv[2], "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2, "logprobs": True, "return_token_ids": True}
req = urllib.request.Request(sys.argv[1], json.dumps(body).encode(),
                             {"content-type": "application/json"})
urllib.request.urlopen(req, timeout=300).read()
PYEOF
}

if [ -f "$PIDFILE" ]; then
    old="$(cat "$PIDFILE")"
    if kill -0 "$old" 2>/dev/null && answers; then
        echo "serve.sh: vLLM already running on port $PORT (pid $old)" >&2
        echo "$old"
        exit 0
    fi
fi
if answers; then
    echo "serve.sh: something else already answers on $URL" >&2
    exit 1
fi

mkdir -p "$LOGS"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
IOMP="$DEST/venv/lib/libiomp5.so"
if [ -z "${VLLM_NO_PRELOAD:-}" ] && [ -f "$IOMP" ] && [[ ":${LD_PRELOAD:-}:" != *":$IOMP:"* ]]; then
    export LD_PRELOAD="$IOMP${LD_PRELOAD:+:$LD_PRELOAD}"
fi

# The module entry point, not the `vllm` command: the package is named vllm-cpu and the
# `vllm` command asks for the version of a distribution named vllm, which fails.
# - the chat template is the tokenizer's (DEST/model/chat_template.jinja);
# - --logprobs-mode processed_logprobs: logprobs after temperature / top-k / top-p, i.e. of
#   the distribution the tokens were sampled from (vLLM's default is raw_logprobs);
# - token ids need no flag: a request with "return_token_ids": true gets prompt_token_ids
#   and choices[].token_ids;
# - --enable-auto-tool-choice with the pythonic parser: requests with tools are accepted
#   (vLLM refuses tool_choice "auto" without it), calls come back as tool_calls.
# shellcheck disable=SC2086
setsid "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" \
    --served-model-name "$NAME" \
    --host 127.0.0.1 --port "$PORT" \
    --dtype "${VLLM_DTYPE:-bfloat16}" \
    --max-model-len "${MAX_MODEL_LEN:-4096}" \
    --enforce-eager \
    --logprobs-mode processed_logprobs \
    --enable-auto-tool-choice --tool-call-parser pythonic \
    --disable-uvicorn-access-log \
    ${VLLM_EXTRA_ARGS:-} \
    </dev/null >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"$PIDFILE"
echo "serve.sh: vLLM pid $PID starting on 127.0.0.1:$PORT as '$NAME' (log: $LOG)" >&2

START=$(date +%s)
while true; do
    ELAPSED=$(( $(date +%s) - START ))
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "serve.sh: vLLM exited during startup; last lines of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        rm -f "$PIDFILE"
        exit 1
    fi
    if answers; then
        if [ -z "${VLLM_SKIP_WARMUP:-}" ]; then
            warm_up || echo "serve.sh: warm-up request failed (see $LOG)" >&2
        fi
        echo "serve.sh: ready after $(( $(date +%s) - START )) s: $URL" >&2
        break
    fi
    if [ "$ELAPSED" -ge "$TIMEOUT" ]; then
        echo "serve.sh: not ready after ${TIMEOUT} s; stopping pid $PID. Last lines of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        kill -- -"$PID" 2>/dev/null || kill "$PID" 2>/dev/null || true
        rm -f "$PIDFILE"
        exit 1
    fi
    if [ $(( ELAPSED % 15 )) -lt 3 ]; then
        last="$(tail -n 1 "$LOG" 2>/dev/null | cut -c1-160)"
        echo "serve.sh: waiting (${ELAPSED} s): ${last}" >&2
    fi
    sleep 3
done
echo "$PID"
