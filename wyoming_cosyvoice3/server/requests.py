"""Checking what a client asked for: the text and the voice of a request.

Pure functions over event data (no I/O) so that every malformed value becomes a typed error
with a Wyoming code: ``invalid-text``, ``empty-text``, ``text-too-long``,
``text-format-not-supported``, ``invalid-voice``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.errors import CosyVoiceError, EmptyText, TextError, TextTooLong, VoiceNotFound
from .limits import MAX_VOICE_FIELD_CHARS
from .protocol import short_repr
from .runtime import VoiceSlot


class TextFormatNotSupported(CosyVoiceError):
    """The request asks for a text format other than plain text (e.g. SSML)."""

    code = "text-format-not-supported"


@dataclass(frozen=True)
class VoiceRequest:
    """The ``voice`` of a request: by name (+ speaker), else by language, else default."""

    name: str | None = None
    language: str | None = None
    speaker: str | None = None


@dataclass(frozen=True)
class SpeakRequest:
    """A one-shot ``synthesize`` or a ``synthesize-start``, checked when it arrives, so that
    a queued request keeps only what it needs (never the client's whole event data).

    Attributes:
        text: the text to speak (one-shot; "" for a stream or when ``problem`` is set).
        voice: the requested voice.
        received: ``time.monotonic()`` when the event arrived.
        problem: why the request cannot be served (sent as its coded ``error``), or None.
    """

    text: str = ""
    voice: VoiceRequest = VoiceRequest()
    received: float = 0.0
    problem: CosyVoiceError | None = None


def parse_request(
    data: Mapping[str, Any], max_chars: int, received: float, with_text: bool = True
) -> SpeakRequest:
    """Check a ``synthesize`` (``with_text``) or ``synthesize-start`` event's data.

    Never raises: a bad field becomes :attr:`SpeakRequest.problem` (the first one found, in
    the order text, text_format, voice).
    """
    try:
        text = check_text(data, max_chars) if with_text else ""
        check_text_format(data)
        voice = parse_voice(data)
    except CosyVoiceError as err:
        return SpeakRequest(received=received, problem=err)
    return SpeakRequest(text=text, voice=voice, received=received)


def check_text(data: Mapping[str, Any], max_chars: int) -> str:
    """The ``text`` of a ``synthesize`` event, validated.

    Raises:
        TextError: missing or not a string (``invalid-text``).
        TextTooLong: more than ``max_chars`` characters.
        EmptyText: blank text.
    """
    if "text" not in data:
        raise TextError("synthesize needs a 'text' field with the text to speak")
    text = data["text"]
    if not isinstance(text, str):
        raise TextError(f"'text' must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise TextTooLong(
            f"text of {len(text)} characters exceeds the limit of {max_chars}; split it or "
            "raise --max-text-chars"
        )
    if not text.strip():
        raise EmptyText("the text is empty; send something to speak")
    return text


def check_chunk_text(data: Mapping[str, Any]) -> str:
    """The ``text`` of a ``synthesize-chunk`` event (may be empty or whitespace)."""
    text = data.get("text", "")
    if not isinstance(text, str):
        raise TextError(f"'text' of synthesize-chunk must be a string, got {type(text).__name__}")
    return text


def check_text_format(data: Mapping[str, Any]) -> None:
    """Only plain text is spoken; ``text_format`` other than ``text`` is refused."""
    text_format = data.get("text_format")
    if text_format is None or text_format == "text":
        return
    raise TextFormatNotSupported(
        f"text_format {short_repr(text_format)} is not supported; send plain text "
        "(text_format 'text')"
    )


def parse_voice(data: Mapping[str, Any]) -> VoiceRequest:
    """Read ``data['voice']``: absent, ``{}``, ``{name, speaker?}``, ``{language}`` or a name.

    Raises:
        VoiceNotFound: a field has the wrong type or is longer than ``MAX_VOICE_FIELD_CHARS``.
    """
    voice = data.get("voice")
    if voice is None:
        return VoiceRequest()
    if isinstance(voice, str):
        voice = {"name": voice}
    if not isinstance(voice, dict):
        raise VoiceNotFound("'voice' must be an object like {\"name\": ...}, got "
                            f"{short_repr(voice)}")
    fields: dict[str, str | None] = {}
    for key in ("name", "language", "speaker"):
        value = voice.get(key)
        if value is not None and not isinstance(value, str):
            raise VoiceNotFound(f"voice '{key}' must be a string, got {short_repr(value)}")
        if value is not None and len(value) > MAX_VOICE_FIELD_CHARS:
            raise VoiceNotFound(f"voice '{key}' is longer than {MAX_VOICE_FIELD_CHARS} "
                                "characters")
        fields[key] = value or None
    return VoiceRequest(**fields)


def _primary(language: str) -> str:
    return language.replace("_", "-").split("-", 1)[0].lower()


def _valid_names(voices: Mapping[str, VoiceSlot]) -> str:
    names = [name for name, slot in voices.items() if slot.installed]
    if names:
        return ", ".join(names)
    problem = next((f"{name}: {slot.problem}" for name, slot in voices.items() if slot.problem),
                   "check the voice catalog and the log")
    return f"(none; {problem})"


def select_voice(
    request: VoiceRequest, voices: Mapping[str, VoiceSlot], default: VoiceSlot | None
) -> VoiceSlot:
    """Pick the voice: by name, else the first voice listing the language, else the default.

    A language matches exactly first (``en-US``), then by its primary subtag (``en``); voices
    whose first language matches are preferred over voices that merely list it.

    Raises:
        VoiceNotFound: unknown or unusable name, a speaker (no voice has speakers), an
            unsupported language, or no installed voice at all; the message lists the
            installed voices.
    """
    valid = _valid_names(voices)
    if request.name is not None:
        slot = voices.get(request.name)
        if slot is None:
            raise VoiceNotFound(f"unknown voice {short_repr(request.name)}; installed voices: "
                                f"{valid}")
        if not slot.installed:
            reason = slot.problem or "it is not prepared yet"
            raise VoiceNotFound(
                f"voice {request.name!r} is not available ({reason}); installed voices: {valid}"
            )
        if request.speaker is not None:
            raise VoiceNotFound(
                f"voice {request.name!r} has no speakers (got speaker {request.speaker!r}); "
                "leave 'speaker' out"
            )
        return slot
    if request.language is not None:
        wanted = request.language.replace("_", "-").lower()
        installed = [slot for slot in voices.values() if slot.installed]
        for match in (
            lambda s: s.entry.languages[0].lower() == wanted,
            lambda s: _primary(s.entry.languages[0]) == _primary(wanted),
            lambda s: any(lang.lower() == wanted for lang in s.entry.languages),
            lambda s: any(_primary(lang) == _primary(wanted) for lang in s.entry.languages),
        ):
            found = next((slot for slot in installed if match(slot)), None)
            if found is not None:
                return found
        languages = sorted({lang for slot in installed for lang in slot.entry.languages})
        raise VoiceNotFound(
            f"no voice speaks {request.language!r}; languages: {', '.join(languages) or '-'}; "
            f"installed voices: {valid}"
        )
    if default is None:
        raise VoiceNotFound(f"no voice is installed; installed voices: {valid}")
    return default
