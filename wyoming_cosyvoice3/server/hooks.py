"""How a tool that starts the server in its own process watches it and changes what it runs,
without the server knowing the tool: the benchmark harness (``bench/serve.py`` in the
repository) is one. Nothing here is a flag, an environment variable or an add-on option; a
caller builds :class:`ServerHooks` and passes it to :func:`.cli.main` (or
:class:`.cli.RunningServer`, :class:`.runtime.ServerRuntime`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from ..engine.options import EngineObserver, EngineOptions, SynthesisOptions

ENGINE_OVERRIDABLE = frozenset(
    f.name for f in fields(EngineOptions) if f.name not in ("preset", "observer"))
"""Fields of :class:`~..engine.options.EngineOptions` a hook may replace: all but the preset
(``synthesis_overrides`` changes it) and the observer (``observer`` is the hook for it)."""


class ServerObserver(EngineObserver):
    """The engine's callbacks and decoding-length hook
    (:class:`~..engine.options.EngineObserver`, handed to the engine as
    ``EngineOptions.observer``) plus what only the server sees. Every method defaults to
    doing nothing; they are called from the event loop and the worker threads, so
    implementations must be thread-safe and quick."""

    def response_pieces(self, starts_samples: Sequence[int], samples: int) -> None:
        """One response was sent in full: where each piece (one engine request) starts in the
        audio it sent, and the audio's length, both in samples at the output rate."""


@dataclass(frozen=True)
class ServerHooks:
    """What a caller installs into a server it starts in its own process.

    Attributes:
        observer: receives the engine's callbacks and :meth:`ServerObserver.response_pieces`,
            and may fix the decoding length
            (:meth:`~..engine.options.EngineObserver.fixed_speech_tokens`); None: nobody watches
            (the engine then pays one ``is None`` test per callback).
        synthesis_overrides: fields of :class:`~..engine.options.SynthesisOptions` replaced in
            the preset's options, for loading and every request, before the server's own
            ``--speed``, seed and time limit are applied (:meth:`SynthesisOptions.replace
            <..engine.options.SynthesisOptions.replace>`); e.g.
            ``{"flow": {"schedule": {"steps": 3}}}``.
        engine_overrides: fields of :class:`~..engine.options.EngineOptions` (those in
            :data:`ENGINE_OVERRIDABLE`) replaced in the options the engine is loaded with,
            after the server's own flags; e.g. ``{"stream_vocoder": False}`` to measure an
            exact derived form against the one it replaced.
    """

    observer: ServerObserver | None = None
    synthesis_overrides: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}))
    engine_overrides: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        """Raises ``ValueError`` (from :meth:`SynthesisOptions.validate
        <..engine.options.SynthesisOptions.validate>`, or for an unknown field) when the
        overrides do not make valid options."""
        unknown = sorted(set(self.engine_overrides) - ENGINE_OVERRIDABLE)
        if unknown:
            known = ", ".join(sorted(ENGINE_OVERRIDABLE))
            raise ValueError(f"engine_overrides: {', '.join(unknown)} is no overridable "
                             f"EngineOptions field ({known})")
        try:
            SynthesisOptions().replace(**self.synthesis_overrides).validate()
        except TypeError as err:  # an unknown field name
            raise ValueError(f"synthesis_overrides: {err}") from err
