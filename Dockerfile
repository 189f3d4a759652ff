# wyoming-cosyvoice3: Wyoming text-to-speech server (Fun-CosyVoice3-0.5B on onnxruntime).
# Also the image of the Home Assistant add-on (cosyvoice3/). Models, voices and caches live in
# the /data volume, never in the image. Multi-arch (amd64 + arm64):
#   docker buildx build --platform linux/amd64,linux/arm64 -t wyoming-cosyvoice3 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    COSYVOICE3_HEALTH_URI_FILE=/tmp/wyoming-cosyvoice3.uri

# The server runs as uid 1000; run.sh starts as root only to make /data writable for it
# (a fresh `-v ./data:/data` or the add-on's /data belong to root), then drops to uid 1000.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin cosyvoice \
    && mkdir -p /data \
    && chown cosyvoice:cosyvoice /data

WORKDIR /app
COPY pyproject.toml README.md LICENSE NOTICE ./
COPY config ./config
COPY wyoming_cosyvoice3 ./wyoming_cosyvoice3
RUN python -m pip install . && rm -rf /app/wyoming_cosyvoice3 /app/build
COPY --chmod=0755 run.sh /app/run.sh

VOLUME /data
EXPOSE 10200

# Healthy while the process answers describe (also while the model downloads or waits for the
# network: a restart would not help); the address is the one the server listens on.
HEALTHCHECK --interval=30s --timeout=15s --start-period=60s --retries=3 \
    CMD ["python", "-m", "wyoming_cosyvoice3.server.healthcheck", "--timeout", "10"]

ENTRYPOINT ["/app/run.sh"]
