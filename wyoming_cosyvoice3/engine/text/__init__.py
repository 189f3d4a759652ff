"""Text front end: normalisation, splitting into pieces, LLM prompt ids (spec sections 3-4).

* :func:`normalize_text` (normalize.py): clean-up and number reading per language.
* :class:`TextFrontend` (frontend.py): pieces of about 60-80 tokens and their prompt ids.

Imports the top engine modules (constants, errors, types) and no other stage.
"""

from .frontend import TextFrontend
from .normalize import normalize_text
from .script import dominant_script, is_english
from .split import is_speakable

__all__ = ["TextFrontend", "dominant_script", "is_english", "is_speakable", "normalize_text"]
