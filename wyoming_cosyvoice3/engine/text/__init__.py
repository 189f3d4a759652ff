"""Text front end: normalisation, splitting into pieces, LLM prompt ids (spec sections 3-4).

* :class:`TextFrontend` (frontend.py): the prompt ids of each piece of a text.
* :func:`normalize_text` (normalize.py): clean-up, each sentence's reading language
  (:func:`reading_language`: script, then a function-word vote), and its numbers read by that
  language's module: lang_en.py (English), lang_cjk.py (zh, ja with wetext; ko symbols),
  lang_eu.py (de, fr, es, it, ru templates); forms.py holds the patterns they share and
  units_en.py the English unit names.
* pieces.py: normalised text cut into pieces of about 60-80 tokens; a response's short first
  piece (:func:`split_first_clause`); :class:`PlannedPiece`, a piece with its token count.
* script.py: writing systems (:func:`dominant_script`).
* :func:`markdown_to_speech` / :class:`MarkdownSpeech` (markdown.py):
  markdown as conversation agents write it turned into plain sentences, whole or streamed;
  applied by the server before the text reaches the engine.
* :func:`read_tokenizer` (tokenizer_load.py): tokenizer.json read in steps that each release
  the GIL (the model loader's parse).

Imports the top engine modules (constants, errors, options) and no other stage.
"""

from .frontend import TextFrontend
from .markdown import MarkdownSpeech, markdown_to_speech
from .normalize import is_english, language_cues, normalize_text, reading_language
from .pieces import PlannedPiece, is_speakable, split_first_clause
from .script import dominant_script
from .tokenizer_load import read_tokenizer

__all__ = [
    "MarkdownSpeech",
    "PlannedPiece",
    "TextFrontend",
    "dominant_script",
    "is_english",
    "is_speakable",
    "language_cues",
    "markdown_to_speech",
    "normalize_text",
    "read_tokenizer",
    "reading_language",
    "split_first_clause",
]
