"""Typed errors of the engine. Each message says what went wrong and how to fix it.

The server maps each class to a coded Wyoming ``error`` event through :attr:`CosyVoiceError.code`.
"""

from __future__ import annotations


class CosyVoiceError(Exception):
    """Base class of every error the engine raises on purpose.

    Attributes:
        code: short machine-readable code, used as the Wyoming ``error`` event's ``code``.
    """

    code = "synthesis-failed"


class ModelFilesMissing(CosyVoiceError):
    """Files of the model directory are missing. ``missing`` lists their names."""

    code = "model-files-missing"

    def __init__(self, model_dir: str, missing: list[str], hint: str = "") -> None:
        self.model_dir = model_dir
        self.missing = list(missing)
        self.hint = hint
        fix = hint or (
            "download the model (run the server without --local-files-only and with network) "
            "or place the files by hand"
        )
        super().__init__(
            f"model directory {model_dir!s} lacks {len(self.missing)} file(s): "
            f"{', '.join(self.missing)}; {fix}"
        )

    def __reduce__(self) -> tuple[type[ModelFilesMissing], tuple[str, list[str], str]]:
        """Pickle with the constructor's arguments (errors cross process boundaries)."""
        return (type(self), (self.model_dir, self.missing, self.hint))


class GraphSignatureMismatch(CosyVoiceError):
    """An ONNX graph's inputs or outputs differ from the published contract."""

    code = "model-invalid"


class ModelLoadError(CosyVoiceError):
    """A model file exists but cannot be loaded (corrupt or truncated)."""

    code = "model-invalid"


class ModelNotReady(CosyVoiceError):
    """The model is still downloading or loading."""

    code = "model-loading"


class VoiceError(CosyVoiceError):
    """A reference clip cannot be used (unreadable, too short, rate too low, too large)."""

    code = "invalid-voice"


class VoiceNotFound(CosyVoiceError):
    """No voice of that name (or language) exists."""

    code = "invalid-voice"


class TextError(CosyVoiceError):
    """The text cannot be synthesised (not a string, empty after normalisation)."""

    code = "invalid-text"


class EmptyText(TextError):
    """The text holds nothing speakable."""

    code = "empty-text"


class TextTooLong(TextError):
    """The text exceeds the configured character limit."""

    code = "text-too-long"


class SynthesisCancelled(CosyVoiceError):
    """``should_stop`` returned True; raised between two model steps."""

    code = "cancelled"


class SynthesisTimeout(CosyVoiceError):
    """A request exceeded its wall-clock limit."""

    code = "timeout"


class SynthesisFailed(CosyVoiceError):
    """A model graph failed while running (wraps the onnxruntime error)."""

    code = "synthesis-failed"
