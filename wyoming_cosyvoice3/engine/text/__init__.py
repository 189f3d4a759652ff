"""Text front end: normalisation, splitting into pieces, LLM prompt ids (spec sections 3-4).

* :class:`TextFrontend` (frontend.py): normalised text (:func:`normalize_text`: clean-up and
  number reading per language, picked by the text's writing system, :func:`dominant_script`,
  :func:`is_english`) cut into pieces of about 60-80 tokens, and their prompt ids.
* :func:`markdown_to_speech` / :class:`MarkdownSpeech` (markdown.py):
  markdown as conversation agents write it turned into plain sentences, whole or streamed;
  applied by the server before the text reaches the engine.
* :func:`read_tokenizer` (tokenizer_load.py): tokenizer.json read in steps that each release
  the GIL (the model loader's parse).

Imports the top engine modules (constants, errors, options) and no other stage.
"""

from .frontend import TextFrontend, dominant_script, is_english, is_speakable, normalize_text
from .markdown import MarkdownSpeech, markdown_to_speech
from .tokenizer_load import read_tokenizer

__all__ = [
    "MarkdownSpeech",
    "TextFrontend",
    "dominant_script",
    "is_english",
    "is_speakable",
    "markdown_to_speech",
    "normalize_text",
    "read_tokenizer",
]
