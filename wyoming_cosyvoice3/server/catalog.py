"""Voice catalog: YAML files naming reference clips (package, data dirs, --voices).

Format (one file holds a top-level ``voices`` list)::

    voices:
      - name: zh-female                 # ASCII id that clients send
        description: Mandarin female    # shown in Home Assistant
        languages: [zh, en]             # ISO 639-1 codes the voice is offered for
        clip: voices/zh-female.wav      # reference clip, 16 kHz or more, 1..30 s
        transcript: 希望你以后能够做的比我还好呦。  # optional: what the clip says (zero-shot)
        instruction: Speak calmly.      # optional: style instruction (instruct mode)
        attribution: {name: ..., url: ...}

Relative clip paths are looked up in the catalog file's directory (not for the built-in
catalog), then in each data dir, then in the model dir; the resolved file must lie inside the
directory it was found under (no ``..`` escapes, symlinks resolved). Files are parsed with
``yaml.safe_load``. A broken entry never stops the server: it is kept with ``problem`` set (the
voice is advertised ``installed: false``) and one warning is logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

_LOGGER = logging.getLogger(__name__)

CATALOG_FILE_NAME = "voices.yaml"
"""Name of the catalog file looked for in every data dir."""
VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""Voice ids are ASCII (Home Assistant stores and sends them verbatim)."""
LANGUAGE_RE = re.compile(r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})*$")
MAX_CATALOG_BYTES = 1 << 20
MAX_CATALOG_VOICES = 256
MAX_TEXT_FIELD_CHARS = 2000

DEFAULT_ATTRIBUTION_NAME = "FunAudioLLM / CosyVoice3 (Apache-2.0)"
DEFAULT_ATTRIBUTION_URL = "https://github.com/FunAudioLLM/CosyVoice"


@dataclass(frozen=True)
class VoiceEntry:
    """One voice of a catalog.

    Attributes:
        name: ASCII id.
        description: human-readable name; defaults to ``name``.
        languages: language codes, most fitting first.
        clip: the clip path as written in the catalog.
        transcript: what the clip says (zero-shot prompt), or None (cross-lingual).
        instruction: style instruction (instruct mode), or None.
        attribution_name / attribution_url: credit shown to clients.
        source: the catalog file it came from.
        search_dirs: directories a relative ``clip`` is looked up in, in order.
        problem: why the entry cannot be used (None when it is well-formed).
    """

    name: str
    description: str
    languages: tuple[str, ...]
    clip: str
    transcript: str | None = None
    instruction: str | None = None
    attribution_name: str = DEFAULT_ATTRIBUTION_NAME
    attribution_url: str = DEFAULT_ATTRIBUTION_URL
    source: str = ""
    search_dirs: tuple[Path, ...] = ()
    problem: str | None = None

    def with_problem(self, problem: str) -> VoiceEntry:
        """A copy marked unusable."""
        return replace(self, problem=problem)


def default_catalog_path() -> Path:
    """The built-in catalog shipped inside the package (source: ``config/voices.yaml`` at the
    top of the repository; ``wyoming_cosyvoice3/config/voices.yaml`` links to it)."""
    return Path(str(resources.files("wyoming_cosyvoice3").joinpath("config", CATALOG_FILE_NAME)))


def _text_field(entry: dict[str, Any], key: str, required: bool = False) -> str | None:
    value = entry.get(key)
    if value is None:
        if required:
            raise ValueError(f"'{key}' is missing")
        return None
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be text, got {type(value).__name__}")
    value = value.strip()
    if len(value) > MAX_TEXT_FIELD_CHARS:
        raise ValueError(f"'{key}' is longer than {MAX_TEXT_FIELD_CHARS} characters")
    if not value and required:
        raise ValueError(f"'{key}' is empty")
    return value or None


def _languages(entry: dict[str, Any]) -> tuple[str, ...]:
    value = entry.get("languages", entry.get("language"))
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("'languages' must be a non-empty list of language codes")
    codes: list[str] = []
    for code in value:
        if not isinstance(code, str) or not LANGUAGE_RE.match(code):
            raise ValueError(f"'languages' holds an invalid code {code!r}")
        if code not in codes:
            codes.append(code)
    return tuple(codes)


def _attribution(entry: dict[str, Any]) -> tuple[str, str]:
    value = entry.get("attribution")
    if value is None:
        return DEFAULT_ATTRIBUTION_NAME, DEFAULT_ATTRIBUTION_URL
    if isinstance(value, str):
        return value.strip(), ""
    if isinstance(value, dict):
        name = value.get("name", DEFAULT_ATTRIBUTION_NAME)
        url = value.get("url", "")
        if isinstance(name, str) and isinstance(url, str):
            return name.strip(), url.strip()
    raise ValueError("'attribution' must be text or {name: ..., url: ...}")


def parse_entry(raw: Any, source: str, search_dirs: tuple[Path, ...], index: int) -> VoiceEntry:
    """Turn one YAML item into a :class:`VoiceEntry`; problems are recorded, never raised.

    Raises:
        ValueError: only when the item has no usable ``name`` (it cannot even be listed).
    """
    if not isinstance(raw, dict):
        raise ValueError(f"entry {index + 1} is not a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not VOICE_NAME_RE.match(name):
        raise ValueError(
            f"entry {index + 1} has no valid 'name' (ASCII letters, digits, '.', '_', '-'; "
            f"at most 64 characters), got {name!r}"
        )
    skeleton = VoiceEntry(name=name, description=name, languages=("en",), clip="",
                          source=source, search_dirs=search_dirs)
    try:
        languages = _languages(raw)
        clip = _text_field(raw, "clip", required=True) or ""
        attribution_name, attribution_url = _attribution(raw)
        return VoiceEntry(
            name=name,
            description=_text_field(raw, "description") or name,
            languages=languages,
            clip=clip,
            transcript=_text_field(raw, "transcript"),
            instruction=_text_field(raw, "instruction"),
            attribution_name=attribution_name,
            attribution_url=attribution_url,
            source=source,
            search_dirs=search_dirs,
        )
    except ValueError as err:
        return skeleton.with_problem(str(err))


def load_catalog_file(path: Path, search_dirs: Sequence[Path]) -> list[VoiceEntry]:
    """Read one catalog file. A file that cannot be parsed yields no voices and one warning."""
    source = str(path)
    try:
        if path.stat().st_size > MAX_CATALOG_BYTES:
            raise ValueError(f"larger than {MAX_CATALOG_BYTES} bytes")
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as err:
        _LOGGER.warning("Voice catalog %s is unreadable and was skipped: %s", source,
                        str(err).replace("\n", " "))
        return []
    if document is None:
        return []
    items = document.get("voices") if isinstance(document, dict) else None
    if not isinstance(items, list):
        _LOGGER.warning("Voice catalog %s was skipped: it needs a top-level 'voices:' list",
                        source)
        return []
    if len(items) > MAX_CATALOG_VOICES:
        _LOGGER.warning("Voice catalog %s lists %d voices; only the first %d are read", source,
                        len(items), MAX_CATALOG_VOICES)
        items = items[:MAX_CATALOG_VOICES]
    entries: list[VoiceEntry] = []
    for index, raw in enumerate(items):
        try:
            entry = parse_entry(raw, source, tuple(search_dirs), index)
        except ValueError as err:
            _LOGGER.warning("Voice catalog %s: %s; entry skipped", source, err)
            continue
        if entry.problem:
            _LOGGER.warning("Voice %r in %s is disabled: %s", entry.name, source, entry.problem)
        entries.append(entry)
    return entries


def merge_entries(groups: Iterable[list[VoiceEntry]]) -> list[VoiceEntry]:
    """Merge catalogs in order; a later entry of the same name replaces the earlier one."""
    merged: dict[str, VoiceEntry] = {}
    for group in groups:
        for entry in group:
            if entry.name in merged:
                _LOGGER.info("Voice %r from %s replaces the one from %s", entry.name,
                             entry.source, merged[entry.name].source)
                del merged[entry.name]  # keep the replacing entry's position last
            merged[entry.name] = entry
    return list(merged.values())


def load_catalogs(
    data_dirs: Sequence[Path], model_dir: Path | None, voices_file: Path | None = None,
    builtin: Path | None = None,
) -> list[VoiceEntry]:
    """The built-in catalog, then ``<data dir>/voices.yaml`` of each data dir, then ``voices_file``.

    ``model_dir`` may be None while the model location is not known yet (clips are resolved
    later, see :func:`resolve_clip`).
    """
    roots = [*data_dirs, *([model_dir] if model_dir is not None else [])]
    groups = [load_catalog_file(builtin or default_catalog_path(), roots)]
    for data_dir in data_dirs:
        candidate = data_dir / CATALOG_FILE_NAME
        if candidate.is_file():
            groups.append(load_catalog_file(candidate, _unique([data_dir, *roots])))
    if voices_file is not None:
        groups.append(load_catalog_file(voices_file, _unique([voices_file.parent, *roots])))
    return merge_entries(groups)


def _unique(paths: Sequence[Path]) -> list[Path]:
    seen: list[Path] = []
    for path in paths:
        if path not in seen:
            seen.append(path)
    return seen


def with_model_dir(entries: Sequence[VoiceEntry], model_dir: Path) -> list[VoiceEntry]:
    """Add ``model_dir`` as the last place to look for clips (once the model is located)."""
    return [
        entry if model_dir in entry.search_dirs
        else replace(entry, search_dirs=(*entry.search_dirs, model_dir))
        for entry in entries
    ]


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.is_relative_to(root)
    except ValueError:
        return False


def resolve_clip(entry: VoiceEntry) -> Path:
    """Locate the entry's clip file inside its search directories.

    Returns:
        The resolved absolute path of an existing file.

    Raises:
        ValueError: the path leaves every allowed directory, or no file exists; the message
            names the directories searched.
    """
    written = Path(entry.clip).expanduser()
    roots = []
    for directory in entry.search_dirs:
        try:
            roots.append(directory.resolve())
        except OSError:
            continue
    escaped = True
    for root in roots:
        try:
            candidate = (written if written.is_absolute() else root / written).resolve()
        except (OSError, RuntimeError):  # a symlink loop, an unreadable directory
            escaped = False
            continue
        if not _inside(candidate, root):
            continue
        escaped = False
        if candidate.is_file():  # a regular file: never a FIFO or a device
            return candidate
    searched = ", ".join(str(r) for r in roots) or "(no directories)"
    if escaped:
        raise ValueError(
            f"clip {entry.clip!r} lies outside the allowed directories ({searched}); "
            "put the clip inside a data dir and use a path relative to it"
        )
    raise ValueError(f"clip {entry.clip!r} not found (looked in {searched})")


def check_clip_size(path: Path, max_bytes: int) -> None:
    """Refuse a clip file larger than ``max_bytes`` (``--max-clip-bytes``) before reading it.

    Raises:
        ValueError: the file is larger (the message names it and the setting).
    """
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"clip {path} has {size} bytes, more than the limit of {max_bytes} "
                         "(use a shorter clip, 3-10 s is plenty, or raise --max-clip-bytes)")
