# wyoming-cosyvoice3: Wyoming text-to-speech server (Fun-CosyVoice3-0.5B on onnxruntime).
# Models, voices and caches live in the /data volume, never in the image.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin cosyvoice \
    && mkdir -p /data \
    && chown cosyvoice:cosyvoice /data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY wyoming_cosyvoice3 ./wyoming_cosyvoice3
RUN python -m pip install . && rm -rf /app/wyoming_cosyvoice3 /app/build
COPY --chmod=0755 run.sh /app/run.sh

USER cosyvoice
VOLUME /data
EXPOSE 10200

# describe -> info; while the model downloads the server still answers (healthy)
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 \
    CMD ["python", "-m", "wyoming_cosyvoice3.server.healthcheck", "--uri", "tcp://127.0.0.1:10200"]

ENTRYPOINT ["/app/run.sh"]
