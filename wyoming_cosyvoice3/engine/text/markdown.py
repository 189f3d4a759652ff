"""Markdown to speech text, for whole texts and for text streamed in arbitrary deltas.

Conversation agents answer in markdown. This pass turns it into plain sentences before
:func:`.frontend.normalize_text`; the block structure is parsed by markdown-it-py
(CommonMark + GFM tables and strikethrough, see :func:`markdown_parser`).
What each block becomes (inline rules: :func:`speak_inline`):

* paragraph, heading, block quote, list item (bullet or number): its text as a sentence of
  its own -- markers (``#``, ``>``, ``-``, ``1.``) are dropped, and a ``.`` (``。`` after a
  Han/kana character) is added when the block does not end in sentence punctuation;
* table: row by row, the header row first; the cells of a row joined by ``", "``; the
  ``|---|`` delimiter row is dropped;
* fenced code block (```` ``` ```` / ``~~~``), thematic break, link reference definition:
  skipped (code read aloud is noise; the agent's prose around it says what it does);
* HTML block: the text between its tags (``<script>``, ``<style>`` and comments: nothing);
* text indented by four blanks is read as text (indented code blocks are disabled).

The result holds one line per block: ``"**Sure!** Here:\\n- Kitchen: on"`` becomes
``"Sure! Here:\\nKitchen: on.\\n"``.

Streaming (:class:`MarkdownSpeech`): deltas may split markers (``"**Su"`` + ``"re!**"``).
The converter holds back what later text can still change and hands out the rest:

1. Blocks are parsed from the complete lines, plus the unfinished last line when its kind can
   no longer change (it starts with a letter, or a list / heading / quote marker and a
   letter; ``"#"`` alone may still become ``"#tag"``). Every block but the last is final
   (CommonMark decides blocks top-down) and is spoken at once.
2. The last block, while it grows, is spoken in *segments*: a segment ends after sentence
   punctuation followed by a blank (or after ``。！？；`` followed by anything) where no
   emphasis, code span, link or table bar is left open; when no such end exists within
   ``window_chars`` characters, the segment ends at the last blank in them.
3. Segments are a function of the block's text only, and a whole text is converted by the
   same steps, so ``markdown_to_speech(text)`` equals the concatenated output of any split of
   ``text`` into deltas.

Bounds: the buffer keeps only the last top-level block (for a list or block quote, its last
item); parsing runs only when a line ends, when a sentence may have ended, or after
``window_chars // 2`` new characters, and an open fenced code block is not re-parsed until a
line that may close it arrives.
"""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from markdown_it import MarkdownIt

from .script import char_script, is_emoji

if TYPE_CHECKING:
    from markdown_it.token import Token

DEFAULT_WINDOW_CHARS = 400
"""Longest stretch of a block held back waiting for a sentence end (the server's
:class:`~wyoming_cosyvoice3.server.streaming_text.SentenceBuffer` uses the same bound)."""

_SENTENCE_ENDS = frozenset(".!?…;:。！？；：")
_CJK_ENDS = frozenset("。！？；")
_CLOSERS = frozenset("\"')]}»”’」』）》】〕〉")
_COMMAS = ",，、"
_CONTAINERS = frozenset({"bullet_list_open", "ordered_list_open", "blockquote_open"})
_FENCE_LINE = re.compile(r"^[\s>]*(?:`{3,}|~{3,})")
_TAG = re.compile(r"<[^<>]*>")
_SKIPPED_HTML = re.compile(r"^\s*<(?:!--|script\b|style\b|\?)", re.IGNORECASE)
_MARKER = re.compile(r"\s*(?:>|[-*+](?=\s)|\d{1,9}[.)](?=\s)|#{1,6}(?=\s))")
_MAY_END = re.compile(r"[.!?…;:][*_~`\"')\]}»”’」』）》】〕〉]*\s")
"""A sentence may have ended (sentence mark, closing markers or quotes, a blank)."""
_EMPHASIS_START = re.compile(r"(?:\*{1,3}|_{1,3}|`{1,2}|~~)[^\W_]")

UnitKind = Literal["text", "row", "html", "skip"]


@dataclass
class _Unit:
    """A leaf block: what is spoken as one line."""

    kind: UnitKind
    start: int
    """First source line (relative to the parsed source)."""
    anchor: int
    """First line of the enclosing top-level block (a list's or quote's item)."""
    content: str = ""
    cells: tuple[str, ...] = ()
    table: int = -1
    """First line of the table of a row (its header row; the delimiter row follows)."""
    open_fence: bool = False
    """A fenced code block without its closing fence (yet)."""


def _units(tokens: list[Token], lines: list[str]) -> Iterator[_Unit]:
    """Leaf blocks of a parsed token stream, in source order.

    A text unit whose last source line ends in a blank gets one blank appended to its
    content (the parser strips it): a sentence end right before it is then known to be
    complete, in a delta ending with ``"here. "`` as in the whole text.
    """
    anchor = 0
    top_kind = ""
    parents: list[Token] = []
    cells: list[str] = []
    row_start = table_start = 0
    for token in tokens:
        start = token.map[0] if token.map else None
        if start is not None and token.level == 0:
            anchor, top_kind = start, token.type
        elif start is not None and token.level == 1 and top_kind in _CONTAINERS:
            anchor = start
        if token.nesting == 1:
            parents.append(token)
            if token.type == "tr_open":
                cells, row_start = [], start or 0
            elif token.type == "table_open":
                table_start = start or 0
        elif token.nesting == -1:
            if parents:
                parents.pop()
            if token.type == "tr_close":
                yield _Unit("row", row_start, anchor, cells=tuple(cells), table=table_start)
        elif token.type == "inline":
            parent = parents[-1] if parents else None
            if parent is not None and parent.type in ("th_open", "td_open"):
                cells.append(token.content)
            elif parent is not None and parent.map is not None:
                last = parent.map[1] - 1
                blank = last < len(lines) and lines[last][-1:] in (" ", "\t")
                content = token.content + " " if blank else token.content
                yield _Unit("text", parent.map[0], anchor, content=content)
        elif token.type == "html_block" and start is not None:
            yield _Unit("html", start, anchor, content=token.content)
        elif start is not None and token.map is not None:  # fence, code_block, hr
            closing = lines[token.map[1] - 1].strip(" \t>") if token.map[1] <= len(lines) else ""
            open_fence = token.type == "fence" and not (
                token.map[1] - token.map[0] >= 2 and closing.startswith(token.markup)
                and not closing.strip(token.markup[0])
            )
            yield _Unit("skip", start, anchor, open_fence=open_fence)


def line_kind_is_decided(line: str) -> bool:
    """True when an unfinished line's block kind cannot change with more characters.

    After optional list / heading / quote markers the line must continue with a letter,
    digit or other character that cannot start another block (``|``, ``<``, ``[``, ``=``,
    ``-``, ``*``... keep it undecided), or with an emphasis or code opener right before a
    letter (``**Sure``).
    """
    position = 0
    while True:
        match = _MARKER.match(line, position)
        if match is None or match.end() == position:
            break
        position = match.end()
    rest = line[position:].lstrip()
    if not rest:
        return False
    first = rest[0]
    if first.isdigit():
        digits = len(rest) - len(rest.lstrip("0123456789"))
        after = rest[digits:digits + 2]
        if not after:
            return False
        return after[0] not in ".)" or (len(after) == 2 and not after[1].isspace())
    if first in "*_`~":
        return _EMPHASIS_START.match(rest) is not None
    if first == "#":  # "#tag" and "#######" are text; "#" and "##" may still be headings
        hashes = len(rest) - len(rest.lstrip("#"))
        return hashes > 6 or (hashes < len(rest) and not rest[hashes].isspace())
    return first not in "-+#>|<=[\\!"


def _segment_end(text: str, final: bool, window: int) -> int | None:
    """End of the first segment of ``text`` (see the module docstring), or None: undecided.

    Depends only on ``text[:end + 1]``, so every split of the text into deltas finds the
    same ends.
    """
    size = len(text)
    index = 0
    while index < size and index < window:
        char = text[index]
        if char in _SENTENCE_ENDS:
            end = index + 1
            while end < size and (
                text[end] in _SENTENCE_ENDS or text[end] in _CLOSERS or text[end] in "*_~`"
            ):
                end += 1
            closed = end < size and (text[end].isspace() or char in _CJK_ENDS)
            if closed and end <= window and not has_unpaired_marker(text[:end]):
                return end
            index = end
            continue
        index += 1
    if size > window:
        blank = text.rfind(" ", window // 4, window)
        return blank if blank > 0 else window
    return size if final else None


def _terminated(text: str) -> str:
    """``text`` ending in sentence punctuation: a trailing comma becomes one, else ``.`` /
    ``。`` is added (after a Han or kana character)."""
    stripped = text.rstrip(_COMMAS + " ")
    if not stripped:
        return ""
    position = len(stripped) - 1
    while position > 0 and stripped[position] in _CLOSERS:
        position -= 1
    if stripped[position] in _SENTENCE_ENDS:
        return stripped
    return stripped + ("。" if char_script(stripped[position]) in ("han", "kana") else ".")


def _speak_html(block: str) -> str:
    if _SKIPPED_HTML.match(block):
        return ""
    return speak_plain(html.unescape(_TAG.sub(" ", block)))


def _speakable(text: str) -> bool:
    return any(char.isalnum() for char in text)


class MarkdownSpeech:
    """Incremental markdown-to-speech converter (see the module docstring).

    One instance per request: :meth:`feed` each delta, then :meth:`flush` once. The
    concatenation of everything returned equals ``markdown_to_speech`` of the whole text.

    Args:
        window_chars: longest stretch held back waiting for a sentence end (>= 40).
    """

    def __init__(self, window_chars: int = DEFAULT_WINDOW_CHARS) -> None:
        if window_chars < 40:
            raise ValueError(f"window_chars must be >= 40, got {window_chars}")
        self.window_chars = window_chars
        self._buffer = ""
        self._base_line = 0
        """Absolute line number of the first line of ``_buffer``."""
        self._done_line = 0
        """Units starting before this absolute line have been spoken completely."""
        self._open_line = -1
        self._open_spoken = 0
        """Characters of the open unit's text already spoken (its start line: _open_line)."""
        self._open_said = ""
        """Speech of the open unit handed out so far."""
        self._unparsed = 0
        self._in_fence = False
        self._context = ""
        """A table's header and delimiter lines, parsed before ``_buffer`` once the rows
        before the open one are dropped (a row alone is not a table)."""
        self._context_lines = 0
        self._carry = ""

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the speech text that no later text can change ("" if none)."""
        # the parser would make NUL a U+FFFD; "\r\n" and "\r" are line ends (a "\r" at the
        # end of a delta waits: a "\n" may follow)
        delta = self._carry + delta.replace("\x00", "")
        self._carry = "\r" if delta.endswith("\r") else ""
        delta = delta[:-1] if self._carry else delta
        delta = delta.replace("\r\n", "\n").replace("\r", "\n")
        if not delta:
            return ""
        self._buffer += delta
        self._unparsed += len(delta)
        if not self._should_parse(delta):
            return ""
        return self._process(final=False)

    def flush(self) -> str:
        """End of text: return the speech of everything held back, and reset."""
        self._buffer += "\n" if self._carry else ""
        out = self._process(final=True)
        self.__init__(self.window_chars)  # type: ignore[misc]
        return out

    # --- internals -----------------------------------------------------------------------
    def _should_parse(self, delta: str) -> bool:
        if self._in_fence:
            if "\n" not in delta:
                return False
            lines = self._buffer[: self._buffer.rfind("\n")].split("\n")
            new_lines = delta.count("\n")
            return any(_FENCE_LINE.match(line) for line in lines[-new_lines:])
        if "\n" in delta or self._unparsed >= self.window_chars // 2:
            return True
        if self._unparsed * 8 < len(self._buffer):
            return False  # amortised: re-parsing a long open block costs its length
        tail = self._buffer[-len(delta) - 8:]
        return any(char in _CJK_ENDS for char in delta) or _MAY_END.search(tail) is not None

    def _process(self, final: bool) -> str:
        self._unparsed = 0
        complete = self._buffer.rfind("\n") + 1
        last_line = self._buffer[complete:]
        if final or not last_line or line_kind_is_decided(last_line):
            source = self._context + self._buffer
        else:
            source = self._context + self._buffer[:complete]
        units = list(_units(block_parser().parse(source), source.split("\n")))
        out: list[str] = []
        for number, unit in enumerate(units):
            line = self._base_line + unit.start - self._context_lines
            if unit.start < self._context_lines or line < self._done_line:
                continue
            if final or number < len(units) - 1:
                out.append(self._finish(unit, line))
                self._done_line = line + 1
            elif unit.kind == "text":
                out.append(self._advance(unit, line))
        self._in_fence = bool(units) and units[-1].open_fence and not final
        if final:
            return "".join(out)
        if units:
            last = units[-1]
            if last.kind == "row" and last.start > last.table + 2:
                # keep the header and delimiter lines as context, drop the rows spoken
                lines = source.split("\n")
                self._trim(last.start - self._context_lines)
                self._context = "\n".join(lines[last.table:last.table + 2]) + "\n"
                self._context_lines = 2
            elif last.kind != "row" or last.table >= self._context_lines:
                self._trim(last.anchor - self._context_lines)
                self._context, self._context_lines = "", 0
        elif not self._buffer[:complete].strip():
            self._trim(self._buffer.count("\n", 0, complete))
        return "".join(out)

    def _trim(self, keep_from_line: int) -> None:
        """Drop the first ``keep_from_line`` lines of the buffer."""
        if keep_from_line <= 0:
            return
        cut = 0
        for _ in range(keep_from_line):
            cut = self._buffer.find("\n", cut) + 1
            if cut == 0:  # not reached: the parser's lines are the buffer's lines
                cut = len(self._buffer)
                break
        self._buffer = self._buffer[cut:]
        self._base_line += keep_from_line

    def _spoken_of(self, line: int) -> tuple[int, str]:
        if line == self._open_line:
            return self._open_spoken, self._open_said
        return 0, ""

    def _advance(self, unit: _Unit, line: int) -> str:
        """Hand out the decided segments of the open (last) text unit."""
        spoken, said = self._spoken_of(line)
        out: list[str] = []
        text = unit.content
        for _ in range(len(text) + 1):  # each pass advances by at least one character
            end = _segment_end(text[spoken:], False, self.window_chars)
            if end is None or end == 0:
                break
            segment = speak_inline(text[spoken:spoken + end])
            spoken += end
            if _speakable(segment):  # a segment of marks alone says nothing
                out.append(segment + " ")
        said += "".join(out)
        self._open_line, self._open_spoken, self._open_said = line, spoken, said
        return "".join(out)

    def _finish(self, unit: _Unit, line: int) -> str:
        """Speech of a final unit (the rest of it when it was open), ending in a newline.

        Segments handed out early end in a blank; the last segment gets the sentence mark.
        """
        spoken, said = self._spoken_of(line)
        self._open_line, self._open_spoken, self._open_said = -1, 0, ""
        if unit.kind == "row":
            text = _terminated(", ".join(cell for cell in map(speak_inline, unit.cells) if cell))
        elif unit.kind == "html":
            text = _terminated(_speak_html(unit.content))
        elif unit.kind == "skip":
            text = ""
        else:
            parts: list[str] = []
            rest = unit.content
            for _ in range(len(rest) + 1):  # each pass advances by at least one character
                if spoken >= len(rest):
                    break
                end = _segment_end(rest[spoken:], True, self.window_chars) or len(rest) - spoken
                segment = speak_inline(rest[spoken:spoken + end])
                spoken += end
                if _speakable(segment):
                    parts.append(_terminated(segment) if spoken >= len(rest) else segment + " ")
            text = "".join(parts)
        if not (said or _speakable(text)):
            return ""
        return text + "\n"


def markdown_to_speech(text: str) -> str:
    """Speech text of a whole markdown ``text``: one line per block (module docstring).

    Plain text without markdown comes back with blanks collapsed per line and a final
    sentence mark on each line.
    """
    converter = MarkdownSpeech()
    return converter.feed(text) + converter.flush()


# -- inline markdown --------------------------------------------------------------------------

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
    """Speech text of one block's inline markdown ``source``.

    What each inline token becomes (CommonMark inline rules plus GFM strikethrough,
    ``MarkdownIt.parseInline``):

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
