"""Model download: fetch the model files from the Hugging Face Hub once, then run offline.

Public API::

    from wyoming_cosyvoice3.download import ensure_model
    model_dir = ensure_model(Path("/data/models"), "int8")

Command line (pre-seeding a machine)::

    python -m wyoming_cosyvoice3.download --download-dir /data/models --llm-precision int8
"""

from __future__ import annotations

from .ensure import DownloadUnavailable, ensure_model, find_missing, hub_offline, resolve_endpoint
from .files import (
    DEFAULT_REVISION,
    EXPORT_REPO,
    MODEL_FILES,
    PUBLISHED_SIZES_BYTES,
    UPSTREAM_REPO,
    HubSource,
    ModelFile,
    llm_files,
    model_files,
    published_size_bytes,
)
from .progress import DownloadCancelled

__all__ = [
    "DEFAULT_REVISION",
    "EXPORT_REPO",
    "MODEL_FILES",
    "PUBLISHED_SIZES_BYTES",
    "UPSTREAM_REPO",
    "DownloadCancelled",
    "DownloadUnavailable",
    "HubSource",
    "ModelFile",
    "ensure_model",
    "find_missing",
    "hub_offline",
    "llm_files",
    "model_files",
    "published_size_bytes",
    "resolve_endpoint",
]
