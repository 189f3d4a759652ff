"""Reading a voice form (multipart upload) and checking its fields and clip.

The fields are checked by the catalog's own parser (:func:`..catalog.parse_entry`) and the clip
by the engine's own decoder (:func:`...engine.voice.audio_io.decode_clip`: readable audio, at least
16 kHz, at least 1 s, not silent, finite samples) plus the catalog's size limit
(``--max-clip-bytes``), so a voice the page accepts is one the catalog would accept. The page
adds two limits of its own: clips longer than the model's 30 s prompt window
(``constants.MAX_PROMPT_SECONDS``, upstream ``frontend.py _extract_speech_token``) are refused
instead of silently cut, and only WAV, FLAC, OGG and MP3 are taken (the stored file keeps its
format; its extension comes from the decoded format, never from the client's file name).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import soundfile as sf
from aiohttp import BodyPartReader, web

from ...engine.constants import MAX_PROMPT_SECONDS
from ...engine.errors import VoiceError
from ...engine.voice.audio_io import decode_clip
from ..catalog import MAX_TEXT_FIELD_CHARS, VOICE_NAME_RE, parse_entry
from .errors import BadRequest, TooLarge

ACCEPTED_FORMATS = {"WAV": "wav", "WAVEX": "wav", "RF64": "wav", "FLAC": "flac", "OGG": "ogg",
                    "MP3": "mp3"}
"""soundfile format -> extension of the stored clip."""
TEXT_FIELDS = ("name", "description", "languages", "transcript", "instruction")
MAX_FORM_PARTS = 16
"""Parts read from one form (six are used); more are refused."""
MAX_FIELD_BYTES = 4 * MAX_TEXT_FIELD_CHARS
"""Bytes of one text field (the catalog's 2000 characters of up to 4 UTF-8 bytes each)."""
_READ_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class VoiceFields:
    """The text fields of a voice form, validated as a catalog entry would be.

    Attributes:
        name: catalog voice id (``catalog.VOICE_NAME_RE``).
        description: shown in Home Assistant (None: the name).
        languages: ISO 639-1 codes, best first.
        transcript: what the clip says (zero-shot), or None (cross-lingual).
        instruction: style instruction (instruct mode), or None.
    """

    name: str
    description: str | None
    languages: tuple[str, ...]
    transcript: str | None
    instruction: str | None

    def apply(self, item: dict[str, Any], clip: str) -> dict[str, Any]:
        """``item`` (an existing catalog mapping, kept key by key) with these fields set."""
        result = dict(item)
        result["name"] = self.name
        result.pop("language", None)
        for key, value in (("description", self.description), ("transcript", self.transcript),
                           ("instruction", self.instruction)):
            if value is None:
                result.pop(key, None)
            else:
                result[key] = value
        result["languages"] = list(self.languages)
        result["clip"] = clip
        order = ["name", "description", "languages", "clip", "transcript", "instruction"]
        return {**{k: result[k] for k in order if k in result}, **result}


@dataclass(frozen=True)
class CheckedClip:
    """An uploaded clip that passed the checks.

    Attributes:
        data: the file's bytes, stored unchanged.
        extension: ``wav``, ``flac``, ``ogg`` or ``mp3``.
        duration_s: length in seconds; rate_hz: sample rate in Hz.
    """

    data: bytes
    extension: str
    duration_s: float
    rate_hz: int


@dataclass
class VoiceForm:
    """A read form: text fields, and the clip's bytes and (display-only) file name."""

    fields: dict[str, str]
    clip: bytes | None = None
    clip_label: str = "upload"


def check_name(name: str) -> str:
    """Raise :class:`BadRequest` unless ``name`` is a valid catalog voice id."""
    if not VOICE_NAME_RE.match(name):
        raise BadRequest(
            f"name {name[:80]!r} is not usable: use 1-64 ASCII letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (it is what Home Assistant sends)"
        )
    return name


def parse_fields(form: Mapping[str, str], name: str | None = None) -> VoiceFields:
    """Validate the form's text fields with the catalog's parser.

    Args:
        form: ``name`` (unless given), ``description``, ``languages`` (codes separated by
            commas or spaces), ``transcript``, ``instruction``; blank means absent.
        name: the voice being edited (its name cannot change).

    Raises:
        BadRequest: the message names the field and what to change.
    """
    voice = check_name(name if name is not None else form.get("name", "").strip())
    languages = [code for code in re.split(r"[\s,;]+", form.get("languages", "")) if code]
    item: dict[str, Any] = {"name": voice, "languages": languages, "clip": "clips/check"}
    for key in ("description", "transcript", "instruction"):
        value = form.get(key, "")
        if value.strip():
            item[key] = value
    entry = parse_entry(item, "voice page", (), 0)
    if entry.problem is not None:
        hint = " (ISO 639-1 codes such as en, de, zh)" if "languages" in entry.problem else ""
        raise BadRequest(f"{entry.problem}{hint}")
    return VoiceFields(voice, item.get("description") and entry.description, entry.languages,
                       entry.transcript, entry.instruction)


def check_clip(data: bytes, label: str, max_bytes: int,
               max_s: float = MAX_PROMPT_SECONDS) -> CheckedClip:
    """Check an uploaded clip as catalog clips are checked (size, format, rate, duration).

    Args:
        data: the uploaded file.
        label: a name for messages (the client's file name, sanitised).
        max_bytes: ``--max-clip-bytes``.
        max_s: longest clip accepted, seconds.

    Raises:
        BadRequest: empty, not audio, another format, too long, or refused by the engine's
            decoder (below 16 kHz, under 1 s, silent, damaged); the message says what to do.
        TooLarge: more than ``max_bytes``.
    """
    if not data:
        raise BadRequest("no clip was sent: choose an audio file or record one")
    if len(data) > max_bytes:
        raise TooLarge(_too_large(max_bytes))
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise BadRequest(f"{label} is not an audio file the server can read; upload WAV, "
                         "FLAC, OGG or MP3 audio") from err
    extension = ACCEPTED_FORMATS.get(str(info.format))
    if extension is None:
        raise BadRequest(f"{label} is {info.format} audio; upload WAV, FLAC, OGG or MP3")
    duration_s = info.frames / info.samplerate if info.samplerate else 0.0
    if duration_s > max_s:
        raise BadRequest(f"{label} is {duration_s:.1f} s long; the model uses at most "
                         f"{max_s:g} s of it: cut it to 3-{max_s:g} s of clear speech")
    try:
        samples, rate_hz = decode_clip(data, label, max_s)
    except VoiceError as err:
        raise BadRequest(str(err)) from err
    return CheckedClip(data, extension, samples.shape[0] / rate_hz, rate_hz)


def _too_large(max_bytes: int) -> str:
    return (f"the clip is larger than the limit of {max_bytes / 1e6:.1f} MB (--max-clip-bytes): "
            "use a 3-30 s clip, for example 16-bit mono WAV or FLAC")


def _label(filename: str | None) -> str:
    """A printable, short version of the client's file name, for messages only."""
    base = (filename or "").replace("\\", "/").rsplit("/", 1)[-1]
    clean = "".join(ch for ch in base if ch.isprintable())[:80]
    return repr(clean) if clean else "the clip"


async def read_form(request: web.Request, max_clip_bytes: int) -> VoiceForm:
    """Read a voice form (``multipart/form-data``, or url-encoded without a clip) without
    holding more than the limits.

    Raises:
        BadRequest: not multipart, too many parts, an unknown or oversized text field.
        TooLarge: the clip part exceeds ``max_clip_bytes`` (reading stops there).
    """
    if request.content_type == "application/x-www-form-urlencoded":  # a form without a file
        posted = await request.post()  # bounded by the app's client_max_size
        fields = {key: value for key, value in posted.items()
                  if key in TEXT_FIELDS and isinstance(value, str)}
        for key, value in fields.items():
            if len(value) > MAX_TEXT_FIELD_CHARS:
                raise BadRequest(f"{key} is longer than {MAX_TEXT_FIELD_CHARS} characters")
        return VoiceForm(fields=fields)
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError) as err:
        raise BadRequest("send the voice as multipart/form-data (a browser form)") from err
    form = VoiceForm(fields={})
    for _ in range(MAX_FORM_PARTS):
        part = await reader.next()
        if part is None:
            return form
        if not isinstance(part, BodyPartReader):
            raise BadRequest("nested multipart forms are not accepted")
        if part.name == "clip":
            data = await _read_part(part, max_clip_bytes, TooLarge)
            if data:  # an empty file input sends an empty part
                form.clip, form.clip_label = data, _label(part.filename)
        elif part.name in TEXT_FIELDS:
            raw = await _read_part(part, MAX_FIELD_BYTES, BadRequest, field=part.name)
            form.fields[part.name] = raw.decode("utf-8", errors="replace")
        else:
            await part.release()
    raise BadRequest(f"the form has more than {MAX_FORM_PARTS} parts")


async def _read_part(part: BodyPartReader, limit: int, error: type[BadRequest] | type[TooLarge],
                     field: str | None = None) -> bytes:
    chunks: list[bytes] = []
    size = 0
    for _ in range(limit + 2):  # bounded: every chunk but the last adds at least one byte
        chunk = await part.read_chunk(_READ_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            if field is not None:
                raise error(f"{field} is longer than {MAX_TEXT_FIELD_CHARS} characters")
            raise error(_too_large(limit))
        chunks.append(chunk)
    raise error("the upload did not end")
