"""Server settings: command-line flags, environment variables and the add-on options file.

Every setting has one flag (``--max-concurrent``), one environment variable
(``COSYVOICE3_MAX_CONCURRENT``) and one key of the Home Assistant add-on options file
(``max_concurrent`` in ``/data/options.json``). Precedence, highest first: command line,
environment, options file, built-in default.

Limits (:class:`Limits`, ``Settings.limits``): the server has no authentication (the Wyoming
protocol has none) and often runs on a small board, so every resource a client can make it
spend is bounded; each bound is a setting like any other, and each exceeded bound is answered
with a coded ``error`` event (codes in :data:`ERROR_CODES`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import __version__
from ..engine.options import LLM_FILES, LLM_GRAPHS, PRESETS
from .machine import AUTO

_LOGGER = logging.getLogger(__name__)

ENV_PREFIX = "COSYVOICE3_"
DEFAULT_URI = "tcp://0.0.0.0:10200"
DEFAULT_OPTIONS_FILE = Path("/data/options.json")
DEFAULT_ZEROCONF_NAME = "cosyvoice3"
DEFAULT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_HTTP_HOST = "127.0.0.1"


# -- limits ---------------------------------------------------------------------------------

TOO_MANY_CONNECTIONS = "too-many-connections"
IDLE_TIMEOUT = "idle-timeout"
SERVER_BUSY = "server-busy"

ERROR_CODES = {
    "max_text_chars": "text-too-long",
    "max_pending_requests": SERVER_BUSY,
    "max_queued_requests": SERVER_BUSY,
    "max_request_s": "timeout",
    "max_connections": TOO_MANY_CONNECTIONS,
    "idle_timeout_s": IDLE_TIMEOUT,
    "max_event_header_bytes": "event-too-large",
    "max_event_data_bytes": "event-too-large",
    "max_event_payload_bytes": "event-too-large",
    "max_clip_bytes": "invalid-voice",
}
"""The ``error`` code sent when each limit is exceeded (``write_timeout_s`` has none: a client
that stops reading cannot read an error either; its connection is dropped)."""


@dataclass(frozen=True)
class Limits:
    """Bounds that keep clients from exhausting the server.

    Attributes:
        max_text_chars: characters of one ``synthesize`` text, and of all the text of one
            streaming request (its ``synthesize-chunk`` pieces summed).
        max_pending_requests: requests one connection may have waiting behind the one being
            answered; more get one ``server-busy`` error per burst.
        max_queued_requests: syntheses waiting for a free worker, over all connections; one
            more is refused with ``server-busy``.
        max_request_s: wall-clock seconds one synthesis (a one-shot text, or the sentences
            of a stream spoken together: a running one takes no more sentences after half of
            this) may run once it has a worker; then ``timeout``.
        max_connections: simultaneous client connections; one more gets
            ``too-many-connections`` and is closed.
        idle_timeout_s: a connection with nothing to answer that sends no event for this long
            gets ``idle-timeout`` and is closed (an open stream waiting for text is idle too).
        write_timeout_s: a connection whose client reads nothing for this long while the
            server has output for it is dropped (its synthesis stops, its worker is freed).
        max_event_header_bytes: length of an event's JSON header line.
        max_event_data_bytes: size of an event's JSON data block (``data_length``).
        max_event_payload_bytes: size of an event's binary payload (``payload_length``); a TTS
            server receives no audio.
        max_clip_bytes: size of a catalog voice's reference clip file (the engine also caps
            clips at 64 MiB and 30 s).
    """

    max_text_chars: int = 10000
    max_pending_requests: int = 16
    max_queued_requests: int = 16
    max_request_s: float = 600.0
    max_connections: int = 32
    idle_timeout_s: float = 120.0
    write_timeout_s: float = 60.0
    max_event_header_bytes: int = 1 << 16
    max_event_data_bytes: int = 1 << 20
    max_event_payload_bytes: int = 1 << 20
    max_clip_bytes: int = 1 << 26


# -- settings -------------------------------------------------------------------------------

class SettingsError(ValueError):
    """A setting has an unusable value; the message names the flag, variable or key."""


@dataclass(frozen=True)
class Settings:
    """Everything the server is configured with (one field per flag; see :func:`build_parser`)."""

    uri: str = DEFAULT_URI
    data_dirs: tuple[Path, ...] = ()
    download_dir: Path | None = None
    model_dir: Path | None = None
    voices_file: Path | None = None
    voice: str | None = None
    llm_precision: str = "int8"
    llm_graph: str = "preset"
    threads: int = 0
    split_cores: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    speed: float = 1.0
    preset: str = AUTO
    samples_per_chunk: int = 1024
    max_preroll_ms: int = 20000
    max_concurrent: int = 1
    streaming: bool = True
    seed: int | None = None
    zeroconf: str | None = None
    local_files_only: bool = False
    warm_up: bool = True
    keep_digits: bool = False
    debug: bool = False
    log_format: str = DEFAULT_LOG_FORMAT
    options_file: Path | None = None
    http_port: int | None = None
    http_host: str = DEFAULT_HTTP_HOST
    http_allow_from: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)

    @property
    def cache_dir(self) -> Path | None:
        """Where prepared voice features are cached: ``<first data dir>/voice-cache``
        (``<download dir>/voice-cache`` without data dirs; None: no disk cache)."""
        return self._writable_dir("voice-cache")

    @property
    def engine_cache_dir(self) -> Path | None:
        """Where the engine keeps files it derives from the model (``engine-cache``)."""
        return self._writable_dir("engine-cache")

    def _writable_dir(self, name: str) -> Path | None:
        if self.data_dirs:
            return self.data_dirs[0] / name
        if self.download_dir is not None:
            return self.download_dir / name
        return None


# --- parsing helpers ----------------------------------------------------------------------


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _speed(text: str) -> float:
    value = float(text)
    if not 0.5 <= value <= 2.0:
        raise ValueError(f"must be within 0.5..2.0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a TCP port 0..65535, got {value}")
    return value


def _networks(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    for part in parts:
        ipaddress.ip_network(part, strict=False)  # ValueError names the bad one
    return parts


def _path_list(text: str) -> list[str]:
    return [part for part in text.split(os.pathsep) if part.strip()]


def _providers(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class _Option:
    """One setting: its flag, destination, ``--help`` group (one of :data:`GROUPS`),
    converter and documentation."""

    flag: str
    dest: str
    help: str
    group: str
    convert: Callable[[str], Any] | None = str
    kind: str = "value"  # value | list | bool-true | bool-false | optional-name
    choices: Sequence[str] | None = None
    metavar: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def positive_key(self) -> str | None:
        """Options-file key without the negation for ``--no-*`` switches (``streaming`` for
        ``--no-streaming``): the add-on shows ``streaming: true`` instead of a double no."""
        return self.dest if self.kind == "bool-false" else None


MODEL = "model and files"
SPEECH = "speech"
SERVER = "server and limits"
VOICE_PAGE = "voice page"
LOGGING = "logging"
GROUPS: tuple[str, ...] = (MODEL, SPEECH, SERVER, VOICE_PAGE, LOGGING)
"""The ``--help`` sections, in order: what is loaded and from where; how speech is made;
what clients get and how much they may ask for; the voice page; the log."""

OPTIONS: tuple[_Option, ...] = (
    # model and files: what is loaded, from where, and how onnxruntime runs it
    _Option("--data-dir", "data_dirs", "directory with models, voices and the voice cache; "
            "repeatable (environment: separated by the path separator ':')", MODEL,
            kind="list"),
    _Option("--download-dir", "download_dir", "where the model is downloaded "
            "(default: the first --data-dir)", MODEL),
    _Option("--model-dir", "model_dir", "a ready model directory; skips downloading", MODEL),
    _Option("--voices", "voices_file", "an extra voice catalog (YAML) read after the built-in "
            "one and the data dirs' voices.yaml", MODEL),
    _Option("--local-files-only", "local_files_only", "never use the network; fail with a "
            "list of missing files instead", MODEL, convert=None, kind="bool-true"),
    _Option("--llm-precision", "llm_precision", "LLM graph to load (default int8)", MODEL,
            choices=tuple(LLM_FILES)),
    _Option("--llm-graph", "llm_graph", "preset (default): measured at start, the fastest "
            "on this CPU of the preset's graphs (quality, balanced: fused or fused-b8; fast: "
            "also fused-q4), prefilling with fused where that is much faster; fused: a "
            "fused-operator graph derived once from the LLM file (the published int8 numbers, "
            "274 instead of 2222 nodes per token); fused-b8: its int8 weights in 8-bit blocks "
            "(activations quantised per block, no further from float than the published "
            "graph); published: run the LLM file as shipped; fused-q4: fused with 4-bit "
            "weights (lossy)",
            MODEL, choices=("preset", *LLM_GRAPHS)),
    _Option("--threads", "threads", "onnxruntime threads per graph; 0 = one per core (default)",
            MODEL, convert=_non_negative_int),
    _Option("--no-split-cores", "split_cores", "decode the LLM one step at a time between "
            "the flow's and the vocoder's calls instead of in a thread of its own beside them "
            "(the default where this process may use 2 or more cores: same audio, and on a "
            "2-core x86 machine a long answer took 0.85x the time)", MODEL, convert=None,
            kind="bool-false"),
    _Option("--providers", "providers", "onnxruntime execution providers, comma-separated "
            "(default CPUExecutionProvider)", MODEL, convert=_providers),
    _Option("--no-warm-up", "warm_up", "skip the short warm-up synthesis after loading",
            MODEL, convert=None, kind="bool-false"),
    # speech: how each request is spoken
    _Option("--voice", "voice", "default voice name (default: the first voice of the catalog)",
            SPEECH),
    _Option("--preset", "preset", "synthesis preset: auto (default) measures this machine at "
            "start (about 1 s) and takes the most exact preset that keeps up with playback and "
            "fits in memory, else balanced; or quality, balanced, fast", SPEECH,
            choices=(AUTO, *PRESETS)),
    _Option("--speed", "speed", "speaking rate, 0.5..2.0 (default 1.0)", SPEECH,
            convert=_speed),
    _Option("--seed", "seed", "fixed random seed: the same text and voice give the same audio "
            "(default: a new seed per request)", SPEECH, convert=int),
    _Option("--keep-digits", "keep_digits", "keep numbers, times, dates and units as digits "
            "instead of reading them as words in each sentence's language", SPEECH,
            convert=None, kind="bool-true"),
    _Option("--samples-per-chunk", "samples_per_chunk", "samples per audio-chunk event "
            "(default 1024)", SPEECH, convert=_positive_int),
    _Option("--max-preroll-ms", "max_preroll_ms", "longest silence one hold may add when "
            "synthesis is slower than real time: each piece (sentence) is held until it can "
            "play through without a pause inside it; the first audio is never held past 2.5 s "
            "after the answer began; 0 sends audio at once (default 20000)", SPEECH,
            convert=_non_negative_int),
    # server and limits: where it listens, what it advertises, what one client may ask for
    # (see Limits; each exceeded limit is a coded error)
    _Option("--uri", "uri", f"where to listen: tcp://HOST:PORT, unix:///PATH or stdio:// "
            f"(default {DEFAULT_URI})", SERVER),
    _Option("--zeroconf", "zeroconf", "announce the server over mDNS for Home Assistant "
            f"discovery, optionally under NAME (default name {DEFAULT_ZEROCONF_NAME})", SERVER,
            kind="optional-name", metavar="NAME"),
    _Option("--no-streaming", "streaming", "do not advertise streaming text input "
            "(synthesize-start/-chunk/-stop)", SERVER, convert=None, kind="bool-false"),
    _Option("--max-concurrent", "max_concurrent", "syntheses running at once; others wait "
            "(default 1)", SERVER, convert=_positive_int),
    _Option("--max-text-chars", "max_text_chars", "longest text accepted per request, also "
            "per stream (default 10000)", SERVER, convert=_positive_int),
    _Option("--max-pending-requests", "max_pending_requests", "requests one connection may "
            "have waiting for their answer (default 16)", SERVER, convert=_positive_int),
    _Option("--max-queued-requests", "max_queued_requests", "syntheses allowed to wait for a "
            "worker before server-busy errors (default 16)", SERVER, convert=_non_negative_int),
    _Option("--max-request-seconds", "max_request_s", "wall-clock limit of one synthesis "
            "(default 600)", SERVER, convert=_positive_float),
    _Option("--max-connections", "max_connections", "simultaneous client connections "
            "(default 32)", SERVER, convert=_positive_int),
    _Option("--idle-timeout-seconds", "idle_timeout_s", "close a connection that has sent "
            "nothing and waited for nothing this long (default 120)", SERVER,
            convert=_positive_float),
    _Option("--write-timeout-seconds", "write_timeout_s", "drop a client that reads nothing "
            "for this long (default 60)", SERVER, convert=_positive_float),
    _Option("--max-event-header-bytes", "max_event_header_bytes", "longest event header "
            "line (default 65536)", SERVER, convert=_positive_int),
    _Option("--max-event-data-bytes", "max_event_data_bytes", "largest event data block "
            "(default 1048576)", SERVER, convert=_positive_int),
    _Option("--max-event-payload-bytes", "max_event_payload_bytes", "largest event payload "
            "(default 1048576)", SERVER, convert=_positive_int),
    _Option("--max-clip-bytes", "max_clip_bytes", "largest reference clip file of a "
            "catalog voice (default 67108864)", SERVER, convert=_positive_int),
    # voice page
    _Option("--http-port", "http_port", "serve the voice page (add, preview and delete voices "
            "in a browser) on this TCP port; off by default; no authentication", VOICE_PAGE,
            convert=_port),
    _Option("--http-host", "http_host", "address the voice page listens on (default "
            f"{DEFAULT_HTTP_HOST}: this machine only)", VOICE_PAGE),
    _Option("--http-allow-from", "http_allow_from", "answer voice page requests only from "
            "these addresses or networks, comma-separated (e.g. 172.30.32.2, Home Assistant's "
            "ingress proxy; default: anyone who can connect)", VOICE_PAGE, convert=_networks),
    # logging
    _Option("--debug", "debug", "log at DEBUG level", LOGGING, convert=None, kind="bool-true"),
    _Option("--log-format", "log_format", "logging format string", LOGGING),
)
"""Every setting, grouped and in the order of ``--help``: the parser, the environment
variables and the options-file keys are all made from this table."""

_LIMIT_FIELDS = frozenset(f.name for f in fields(Limits))


def build_parser() -> argparse.ArgumentParser:
    """The ``wyoming-cosyvoice3`` argument parser, one argument group per entry of
    :data:`GROUPS`; values left out stay unset (``SUPPRESS``)."""
    parser = argparse.ArgumentParser(
        prog="wyoming-cosyvoice3",
        description="Wyoming text-to-speech server running Fun-CosyVoice3-0.5B on onnxruntime. "
        f"Every flag can also be set with an environment variable ({ENV_PREFIX}<FLAG>, e.g. "
        f"{ENV_PREFIX}VOICE) or a key of the add-on options file (e.g. \"voice\").",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sections = {name: parser.add_argument_group(name) for name in GROUPS}
    sections[MODEL].add_argument(
        "--options-file", dest="options_file", help="add-on options file "
        f"(default {DEFAULT_OPTIONS_FILE} when it exists) [env {ENV_PREFIX}OPTIONS_FILE]")
    for opt in OPTIONS:
        section = sections[opt.group]
        text = f"{opt.help} [env {opt.env}]"
        if opt.kind == "list":
            section.add_argument(opt.flag, dest=opt.dest, action="append", help=text)
        elif opt.kind == "bool-true":
            section.add_argument(opt.flag, dest=opt.dest, action="store_true", help=text)
        elif opt.kind == "bool-false":
            section.add_argument(opt.flag, dest=opt.dest, action="store_false", help=text)
        elif opt.kind == "optional-name":
            section.add_argument(opt.flag, dest=opt.dest, nargs="?", const=DEFAULT_ZEROCONF_NAME,
                                 metavar=opt.metavar, help=text)
        else:
            section.add_argument(opt.flag, dest=opt.dest, type=_argparse_type(opt),
                                 choices=opt.choices, help=text)
    return parser


def _argparse_type(opt: _Option) -> Callable[[str], Any]:
    convert = opt.convert or str

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{opt.flag}: {err}") from err

    return parse


def _from_text(opt: _Option, text: str, source: str) -> Any:
    """Convert an environment value (always text) for ``opt``."""
    try:
        if opt.kind == "list":
            return _path_list(text)
        if opt.kind == "bool-true":
            return _parse_bool(text)
        if opt.kind == "bool-false":
            return not _parse_bool(text)
        if opt.kind == "optional-name":
            try:
                return DEFAULT_ZEROCONF_NAME if _parse_bool(text) else None
            except ValueError:
                return text.strip()
        value = (opt.convert or str)(text)
    except ValueError as err:
        raise SettingsError(f"{source}: {err}") from err
    _check_choice(opt, value, source)
    return value


def _from_json(opt: _Option, value: Any, source: str) -> Any:
    """Convert an options-file value (JSON typed) for ``opt``; ``None``/"" mean unset."""
    if value is None or value == "":
        return _UNSET
    if isinstance(value, bool) and opt.kind in ("bool-true", "bool-false", "optional-name"):
        if opt.kind == "bool-true":
            return value
        if opt.kind == "bool-false":
            return not value
        return DEFAULT_ZEROCONF_NAME if value else None
    if opt.kind == "list":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise SettingsError(f"{source}: expected a list of paths, got {value!r}")
    if isinstance(value, (dict, list)) and opt.dest not in ("providers", "http_allow_from"):
        raise SettingsError(f"{source}: expected a single value, got {value!r}")
    if opt.dest == "providers" and isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, list):  # http_allow_from as a JSON list
        return _from_text(opt, ",".join(str(v) for v in value), source)
    return _from_text(opt, str(value), source)


def _check_choice(opt: _Option, value: Any, source: str) -> None:
    if opt.choices is not None and value not in opt.choices:
        raise SettingsError(f"{source}: must be one of {', '.join(opt.choices)}, got {value!r}")


class _Unset:
    pass


_UNSET = _Unset()


def load_options_file(path: Path) -> dict[str, Any]:
    """Read the add-on options file (a JSON object); raise :class:`SettingsError` when broken."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SettingsError(f"cannot read options file {path}: {err}") from err
    if not isinstance(data, dict):
        raise SettingsError(f"options file {path} must hold a JSON object")
    return data


def resolve_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Merge command line, environment and options file into :class:`Settings`.

    Raises:
        SettingsError: a value is invalid (the message names its source), or neither
            ``--data-dir`` nor ``--model-dir`` is given anywhere.
        SystemExit: from argparse for ``--help``, ``--version`` or a malformed flag.
    """
    env = os.environ if environ is None else environ
    cli = vars(build_parser().parse_args(argv))

    options_path: Path | None = None
    if "options_file" in cli:
        options_path = Path(cli.pop("options_file"))
    elif env.get(ENV_PREFIX + "OPTIONS_FILE"):
        options_path = Path(env[ENV_PREFIX + "OPTIONS_FILE"])
    elif DEFAULT_OPTIONS_FILE.is_file():
        options_path = DEFAULT_OPTIONS_FILE
    file_values = load_options_file(options_path) if options_path is not None else {}
    known_keys = {opt.key for opt in OPTIONS} | {o.positive_key for o in OPTIONS if o.positive_key}
    for key in file_values:
        if key not in known_keys:
            _LOGGER.warning("Ignoring unknown key %r in options file %s", key, options_path)

    merged: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.dest in cli:
            value = cli[opt.dest]
        elif env.get(opt.env) is not None:
            value = _from_text(opt, env[opt.env], f"environment variable {opt.env}")
        elif opt.key in file_values:
            value = _from_json(opt, file_values[opt.key], f"option {opt.key!r} of {options_path}")
            if value is _UNSET:
                continue
        elif opt.positive_key is not None and opt.positive_key in file_values:
            raw = file_values[opt.positive_key]
            source = f"option {opt.positive_key!r} of {options_path}"
            if raw is None or raw == "":
                continue
            if not isinstance(raw, bool):
                raise SettingsError(f"{source}: expected true or false, got {raw!r}")
            value = raw
        else:
            continue
        merged[opt.dest] = value

    limits = Limits(**{k: merged.pop(k) for k in list(merged) if k in _LIMIT_FIELDS})
    for key in ("data_dirs",):
        if key in merged:
            merged[key] = tuple(Path(p).expanduser() for p in merged[key])
    for key in ("download_dir", "model_dir", "voices_file"):
        if key in merged and merged[key] is not None:
            merged[key] = Path(merged[key]).expanduser()
    if "http_allow_from" in merged:
        merged["http_allow_from"] = tuple(merged["http_allow_from"])
    if "providers" in merged:
        merged["providers"] = tuple(merged["providers"]) or ("CPUExecutionProvider",)
    settings = Settings(limits=limits, options_file=options_path, **merged)
    if not settings.data_dirs and settings.model_dir is None:
        raise SettingsError(
            "no model location: give --data-dir DIR (the model is downloaded there) or "
            f"--model-dir DIR (a ready model), or set {ENV_PREFIX}DATA_DIR / {ENV_PREFIX}MODEL_DIR"
        )
    return settings


def describe_settings_table() -> list[tuple[str, str, str, str]]:
    """(flag, environment variable, options key, help) rows, for the README."""
    return [(opt.flag, opt.env, opt.key, opt.help) for opt in OPTIONS]
