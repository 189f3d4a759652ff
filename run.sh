#!/usr/bin/env bash
# Entry point of the container and of the Home Assistant add-on.
# Serves on tcp://0.0.0.0:10200 with /data as data dir (models, voices.yaml, caches) and, in
# the add-on, /config (the add-on configuration folder: the user's voices.yaml and clips).
# The add-on options file /data/options.json is read by the server itself; its keys are the
# flag names with underscores (see README, Configuration). Extra arguments are passed through.
set -euo pipefail

data_dir="${COSYVOICE3_CONTAINER_DATA_DIR:-/data}"
config_dir="${COSYVOICE3_CONTAINER_CONFIG_DIR:-/config}"
run_uid="${COSYVOICE3_CONTAINER_UID:-1000}"
server="${COSYVOICE3_CONTAINER_SERVER:-wyoming-cosyvoice3}"

args=(--data-dir "${data_dir}")
if [[ -d "${config_dir}" ]]; then
    args+=(--data-dir "${config_dir}")
fi
if [[ -f "${data_dir}/options.json" ]]; then
    args+=(--options-file "${data_dir}/options.json")
fi
if [[ -n "${SUPERVISOR_TOKEN:-}" ]]; then
    # Home Assistant add-on: the voice page for the ingress proxy only (config.yaml ingress_port)
    args+=(--http-port 8099 --http-host 0.0.0.0 --http-allow-from 172.30.32.2)
fi

can_write() {  # can_write DIR [UID]: DIR is writable (by UID when given and we are root)
    local probe="$1/.cosyvoice3-write-test.$$"
    if [[ -n "${2:-}" ]]; then
        setpriv --reuid="$2" --regid="$2" --clear-groups touch "${probe}" 2>/dev/null || return 1
    else
        touch "${probe}" 2>/dev/null || return 1
    fi
    rm -f "${probe}"
}

not_writable() {
    local owner
    owner="$(stat -c '%u:%g' "$1" 2>/dev/null || echo '?')"
    cat >&2 <<MSG
wyoming-cosyvoice3: ${1} is not writable by uid $(id -u) (it belongs to ${owner}).
The model (about 3 GB), the voice cache and derived files are stored there. Fix it on the host:
    sudo chown -R ${2}:${2} ./data      # the directory you mount at ${1}
or start the container as root (it then fixes the owner itself), or as its owner with
    docker run --user "\$(stat -c %u:%g ./data)" ...
MSG
    exit 78
}

mkdir -p "${data_dir}" 2>/dev/null || true
if [[ "$(id -u)" -eq 0 ]] && command -v setpriv >/dev/null; then
    # root: give the data dirs to the server user when it cannot write them, then drop root
    for dir in "${data_dir}" "${config_dir}"; do
        [[ -d "${dir}" ]] || continue
        if ! can_write "${dir}" "${run_uid}"; then
            echo "wyoming-cosyvoice3: giving ${dir} to uid ${run_uid}" >&2
            chown -R "${run_uid}:${run_uid}" "${dir}" || true
        fi
    done
    can_write "${data_dir}" "${run_uid}" || not_writable "${data_dir}" "${run_uid}"
    exec setpriv --reuid="${run_uid}" --regid="${run_uid}" --init-groups \
        env HOME="$(getent passwd "${run_uid}" | cut -d: -f6 || echo /tmp)" \
        "${server}" "${args[@]}" "$@"
fi
can_write "${data_dir}" || not_writable "${data_dir}" "$(id -u)"
exec "${server}" "${args[@]}" "$@"
