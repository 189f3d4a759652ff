"""Wyoming text-to-speech server for Fun-CosyVoice3-0.5B on onnxruntime."""

__version__ = "0.1.0"
