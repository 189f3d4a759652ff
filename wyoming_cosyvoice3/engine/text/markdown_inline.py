"""Inline markdown to speech: emphasis, code spans, links, images, HTML tags, URLs, emoji.

Used by :mod:`.markdown` for the text of one block (paragraph, heading, list item, table
cell). Inline syntax is parsed by markdown-it-py (CommonMark inline rules plus GFM
strikethrough, ``MarkdownIt.parseInline``); what each token becomes:

==================  =========================================================================
token               spoken as
==================  =========================================================================
text                itself, after the text rules below
strong / em         their text (the ``*`` / ``_`` markers are dropped)
s (``~~x~~``)       nothing: struck-through text is not meant any more
code_inline         its content (short code spans in agent replies are names: `light.kitchen`)
link                its link text; an autolink ``<https://a.b/c>`` its host name;
                    ``[text][label]`` (resolved only against the whole document) its text,
                    a bare citation ``[1]`` nothing
image               its alt text (with ``.`` when words follow it)
html_inline         nothing (the tag is dropped, the text between tags is kept)
soft / hard break   a blank
==================  =========================================================================

Text rules: a bare URL (``https://...``, ``www....``) becomes its host name without ``www.``
(``https://www.met.no/x?y`` -> ``met.no``); emoji, their variation selectors, skin tones and
zero-width joiners are dropped (keycap digits keep the digit); a leading task-list box
``[ ]`` / ``[x]`` is dropped; ``*``, ``_``, backtick and ``~~`` runs that the parser left
unpaired are dropped, and so are table bars ``|`` outside a table and ``<`` ``>`` of a tag
left open, except a ``*``, ``_``, ``<`` or ``>`` standing between blanks or inside a word
(``5 * 3``, ``snake_case``, ``5 < 7``). Letters and digits of every script are never removed.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from markdown_it import MarkdownIt

from .normalize import is_emoji

if TYPE_CHECKING:
    from markdown_it.token import Token

_URL = re.compile(
    r"(?:(?:https?|ftp)://|www\.)(?P<host>[^\s/?#<>()\[\]\"'`]+)[^\s<>\"'`]*?(?=[.,;:!?)\]]*(?:\s|$))",
    re.IGNORECASE,
)
_TASK_BOX = re.compile(r"^\s*\[[ xX]\]\s+")
_REFERENCE = re.compile(r"\[([^\[\]]*)\]\[[^\[\]]*\]")
_CITATION = re.compile(r"\s?\[\d{1,3}\]")
_DELIMITER_RUN = re.compile(r"\*+|_+|`+|~~+|\|+|[<>]")
_LINE_BREAK_TAG = re.compile(r"<br\b", re.IGNORECASE)
_BLANKS = re.compile(r"\s+")
_JOINERS = frozenset({"\u200d", "\u20e3", "\ufe0e", "\ufe0f"})
_MAX_BRACKETS = 32
_LEFTOVER_CHARS = frozenset("*_`~[]|<")
"""Characters whose presence in a text token means that a marker was left unpaired."""


@lru_cache(maxsize=1)
def markdown_parser() -> MarkdownIt:
    """The shared parser: CommonMark with HTML, GFM tables and strikethrough, no indented code.

    Indented code blocks are disabled on purpose: plain text indented by four blanks must be
    spoken, not skipped. The instance is configured once and only read afterwards (each
    ``parse`` call builds its own state), so threads may share it.
    """
    return (
        MarkdownIt("commonmark", {"html": True})
        .enable(["table", "strikethrough"])
        .disable(["code"])
    )


@lru_cache(maxsize=1)
def block_parser() -> MarkdownIt:
    """:func:`markdown_parser` without the inline pass: block tokens whose ``inline``
    tokens carry their source text (``content``) and no children (cheaper to re-parse)."""
    return (
        MarkdownIt("commonmark", {"html": True})
        .enable(["table", "strikethrough"])
        .disable(["code", "inline"])
    )


def host_of(url_match: re.Match[str]) -> str:
    """Host name of a matched URL without ``www.``, user info or port."""
    host = url_match.group("host").rsplit("@", 1)[-1].split(":", 1)[0]
    return host[4:] if host.lower().startswith("www.") else host


def _drop_emoji(text: str) -> str:
    kept = []
    for index, char in enumerate(text):
        if char in _JOINERS or is_emoji(ord(char)):
            # a keycap "1️⃣" is a digit + VS16 + U+20E3: the digit is kept, the rest dropped
            continue
        if unicodedata.category(char) == "So" and index + 1 < len(text) and (
            text[index + 1] == "\ufe0f"
        ):
            continue  # a symbol shown as emoji (e.g. "©️")
        kept.append(char)
    return "".join(kept)


def _drop_leftover_markers(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        run = match.group(0)
        start, end = match.span()
        before = text[start - 1] if start > 0 else " "
        after = text[end] if end < len(text) else " "
        if run[0] in "*_<>" and len(run) == 1 and (
            (before.isspace() and after.isspace()) or (before.isalnum() and after.isalnum())
        ):
            return run  # "5 * 3", "snake_case", "5 < 7": not a marker
        return ""

    return _DELIMITER_RUN.sub(replace, text)


def speak_plain(text: str) -> str:
    """The text rules of the module docstring on plain text (no markdown parsing)."""
    text = _URL.sub(host_of, text)
    text = _drop_emoji(text)
    text = _drop_leftover_markers(text)
    return _BLANKS.sub(" ", text).strip()


def _alt_sentence(alt: str, following: Sequence[Token]) -> str:
    """An image's alt text, ended with ``.`` when words follow it in the same block."""
    alt = alt.strip()
    rest = "".join(t.content for t in following if t.type in ("text", "code_inline")).lstrip()
    if alt and alt[-1].isalnum() and rest[:1].isalnum():
        return alt + ". "
    return alt


def _speak_tokens(tokens: Sequence[Token]) -> str:
    parts: list[str] = []
    struck = 0
    for index, token in enumerate(tokens):
        kind = token.type
        if kind in ("s_open", "s_close"):
            struck = max(0, struck + (1 if kind == "s_open" else -1))
        elif struck:
            continue  # struck-through text is not said
        elif kind in ("text", "text_special", "code_inline"):
            parts.append(token.content)
        elif kind == "image":
            parts.append(_alt_sentence(token.content, tokens[index + 1:]))
        elif kind in ("softbreak", "hardbreak") or (
            kind == "html_inline" and _LINE_BREAK_TAG.match(token.content)
        ):
            parts.append(" ")
        # strong/em/s/link open+close and other html tags add nothing
    return "".join(parts)


def _parse_inline(source: str) -> Sequence[Token]:
    """Inline tokens of ``source``; a text with more than ``_MAX_BRACKETS`` ``[`` is parsed
    without its brackets (markdown-it's link-label scan is quadratic in their number:
    400 ``[`` took 0.14 s), which no real link text comes near."""
    if source.count("[") > _MAX_BRACKETS:
        source = source.replace("[", " ").replace("]", " ")
    tokens = markdown_parser().parseInline(source)
    return tokens[0].children if tokens and tokens[0].children else []


def speak_inline(source: str) -> str:
    """Speech text of one block's inline markdown ``source`` (see the module docstring).

    Returns:
        One line of text (blanks collapsed, stripped); empty when nothing is left.
    """
    children = _parse_inline(source)
    text = _TASK_BOX.sub("", _speak_tokens(children))
    # references resolve only against the whole document: "[text][label]" -> "text",
    # a citation "[1]" -> nothing, any other bracket is dropped
    text = _REFERENCE.sub(r"\1", text)
    text = _CITATION.sub("", text)
    return speak_plain(text.replace("[", "").replace("]", ""))


def has_unpaired_marker(source: str) -> bool:
    """True when inline ``source`` leaves a marker the parser could still pair with later text.

    Used to keep ``**Sure! Here**`` whole: the first sentence alone leaves ``**`` unpaired.
    A ``*`` or ``_`` between blanks or inside a word is not counted (see
    :func:`_drop_leftover_markers`).
    """
    for token in _parse_inline(source):
        if token.type != "text":
            continue
        content = token.content
        if not _LEFTOVER_CHARS.intersection(content):
            continue
        if _drop_leftover_markers(content) != content:
            return True
        if any(char in "[]|<`" for char in content):
            return True
    return False
