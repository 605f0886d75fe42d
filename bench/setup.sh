#!/usr/bin/env bash
# What the benchmarks need besides the project's venv: wrk, the HTTP load generator of bench/api.py.
# Idempotent: does nothing when wrk is already on PATH.
set -euo pipefail
if command -v wrk >/dev/null 2>&1; then
    echo "wrk: $(command -v wrk)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq wrk
echo "wrk: $(command -v wrk)"
