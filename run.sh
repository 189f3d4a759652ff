#!/usr/bin/env bash
# Entry point of the container and of the Home Assistant add-on.
# Serves on tcp://0.0.0.0:10200 with /data as data dir (models, voices.yaml, voice cache).
# The add-on options file /data/options.json is read by the server itself; its keys are the
# flag names with underscores (see README, Configuration). Extra arguments are passed through.
set -euo pipefail

data_dir="${COSYVOICE3_CONTAINER_DATA_DIR:-/data}"
args=(--data-dir "${data_dir}")
if [[ -f "${data_dir}/options.json" ]]; then
    args+=(--options-file "${data_dir}/options.json")
fi

exec wyoming-cosyvoice3 "${args[@]}" "$@"
