"""Which files make a model directory, where each comes from, and how big they are.

Sources: the file table of the export's model card (``Masterx/Fun-CosyVoice3-0.5B-2512-ONNX``,
section "Files") and its note that campplus.onnx, speech_tokenizer_v3.onnx and
flow.decoder.estimator.fp32.onnx are fetched from the upstream repository
``FunAudioLLM/Fun-CosyVoice3-0.5B-2512`` (spec/pipeline.md section 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from ..engine.options import LLM_FILES

EXPORT_REPO = "Masterx/Fun-CosyVoice3-0.5B-2512-ONNX"
"""Hugging Face repository of the ONNX export (tokenizer, embeddings, LLM, flow encoder, HiFT)."""
UPSTREAM_REPO = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
"""Upstream model repository (speaker encoder, speech tokenizer, DiT estimator)."""
DEFAULT_REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"

EXPORT_COMMON_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "text_embedding_fp16.onnx",
    "speech_embedding.onnx",
    "flow_encoder.onnx",
    "hift.onnx",
    "voices/zh-female.wav",
    "voices/en-male.wav",
)
"""Files of the export repository that every LLM precision needs."""
UPSTREAM_FILES: tuple[str, ...] = (
    "campplus.onnx",
    "speech_tokenizer_v3.onnx",
    "flow.decoder.estimator.fp32.onnx",
)
"""Files taken from the upstream repository."""

PUBLISHED_SIZES_BYTES: dict[str, int] = {
    "tokenizer.json": 10573953,
    "text_embedding_fp16.onnx": 272269531,
    "speech_embedding.onnx": 24231610,
    "flow_encoder.onnx": 4468501,
    "hift.onnx": 83437283,
    "voices/zh-female.wav": 334138,
    "voices/en-male.wav": 418604,
    "llm.onnx": 1011491,
    "llm.onnx.data": 1455799296,
    "llm_int8.onnx": 3155420,
    "llm_int8.onnx.data": 364146048,
    "llm_q4.onnx": 1052253,
    "llm_q4.onnx.data": 227689392,
    "campplus.onnx": 28303423,
    "speech_tokenizer_v3.onnx": 969451503,
    "flow.decoder.estimator.fp32.onnx": 1326216933,
}
"""Sizes of the released files (public download manifest of revision ``main``). Used only for
the disk-space table of the documentation; downloads are checked against the sizes the hub
reports, never against these numbers."""


@dataclass(frozen=True)
class ModelFile:
    """One file of the model directory.

    Attributes:
        filename: path relative to the model directory and to the repository root, with ``/``
            separators (``voices/en-male.wav``).
        source: ``"export"`` or ``"upstream"``: which of the two repositories holds it.
    """

    filename: str
    source: str


@dataclass(frozen=True)
class HubSource:
    """Where to fetch from: repository ids and revisions of both repositories and the endpoint."""

    export_repo: str = EXPORT_REPO
    export_revision: str = DEFAULT_REVISION
    upstream_repo: str = UPSTREAM_REPO
    upstream_revision: str = DEFAULT_REVISION
    endpoint: str = DEFAULT_ENDPOINT

    def repo_of(self, file: ModelFile) -> tuple[str, str]:
        """Return ``(repo_id, revision)`` holding ``file``."""
        if file.source == "upstream":
            return self.upstream_repo, self.upstream_revision
        return self.export_repo, self.export_revision

    def url_of(self, file: ModelFile) -> str:
        """Direct download URL of ``file`` (the hub's ``/resolve/`` address)."""
        repo_id, revision = self.repo_of(file)
        return (
            f"{self.endpoint.rstrip('/')}/{repo_id}/resolve/"
            f"{quote(revision, safe='')}/{quote(file.filename)}"
        )


def llm_files(precision: str) -> tuple[str, str]:
    """Return the LLM graph and its external-data file for ``precision`` (fp32, int8, q4).

    Raises:
        ValueError: unknown precision (the message lists the valid ones).
    """
    if precision not in LLM_FILES:
        raise ValueError(f"LLM precision must be one of {sorted(LLM_FILES)}, got {precision!r}")
    graph = LLM_FILES[precision]
    return graph, graph + ".data"


def model_files(precision: str = "int8") -> list[ModelFile]:
    """Every file a model directory needs for ``precision``, in download order.

    Small files come first so a missing large file is reported after the cheap ones are in
    place. Raises ``ValueError`` for an unknown precision.
    """
    files = [ModelFile(name, "export") for name in EXPORT_COMMON_FILES]
    files += [ModelFile(name, "export") for name in llm_files(precision)]
    files += [ModelFile(name, "upstream") for name in UPSTREAM_FILES]
    return files


MODEL_FILES: dict[str, list[ModelFile]] = {p: model_files(p) for p in LLM_FILES}
"""File list per LLM precision (``fp32``, ``int8``, ``q4``)."""


def published_size_bytes(precision: str) -> int:
    """Disk space of a complete model directory for ``precision`` from the published sizes."""
    return sum(PUBLISHED_SIZES_BYTES[f.filename] for f in model_files(precision))
