"""Derive-or-fall-back: the one place that chooses among a graph's forms.

A stage's graph has forms in order of preference (the tables are in :mod:`...loaders`): derived
ones first, the published file last. :func:`load_first` walks such a table. A derived form is
made by its ``open``, which calls its module's ``ensure_*`` (:func:`.files.derive_once`: reuse
the cached files keyed by the source file's size and mtime and the derivation's tag, else
derive by structure, validate against the source and store; a failure leaves a ``.failed``
marker and is not retried) and opens the result. Any failure of a form (no cache directory,
structure not recognised, validation failed, the file cannot be opened) is logged as ONE
warning naming the form and the reason, and the next form is tried. The last form of a table
is the published graph: its errors are the caller's (a missing or corrupt model file).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from ...errors import GraphSignatureMismatch, ModelFilesMissing, ModelLoadError
from .files import derived_files_dir

log = logging.getLogger(__name__)

T = TypeVar("T")

FALLBACK_ERRORS: tuple[type[Exception], ...] = (
    ModelLoadError, ModelFilesMissing, GraphSignatureMismatch,
)
"""What makes a derived form fall back (derivation, validation, opening; :mod:`.files` wraps
every other derivation error in ModelLoadError)."""


@dataclass(frozen=True)
class Form(Generic[T]):
    """One form of a stage's graph.

    Attributes:
        name: the form, for the logs ("int8 DiT estimator").
        open: ``open(cache_dir)`` derives the form once (into ``cache_dir``; None for the
            published form), validates it and returns it loaded; returns None when the form
            does not apply to this model without anything being wrong (e.g. the text
            embedding is not a plain lookup: no warning). Raises one of
            :data:`FALLBACK_ERRORS` on failure.
        warning: the fallback warning, a ``%``-format with one ``%s`` for the reason
            (``"int8 DiT estimator not available (%s); using the fp32 estimator"``).
        wanted: whether the options ask for this form (evaluated when the table is walked).
        derived: True for a derived form (it needs the cache directory, and its failures
            fall back); False for the published graph.
    """

    name: str
    open: Callable[[Path | None], T | None]
    warning: str = "%s"
    wanted: bool = True
    derived: bool = True

    def attempt(self, model_dir: Path, cache_dir: Path | None) -> T | None:
        """This form loaded, or None after ONE warning (or none, when it does not apply).

        Raises:
            Whatever ``open`` raises when the form is not derived (the published graph).
        """
        if not self.derived:
            return self.open(None)
        try:
            return self.open(derived_files_dir(model_dir, cache_dir))
        except FALLBACK_ERRORS as exc:
            log.warning(self.warning, exc)
            return None


def load_first(forms: Sequence[Form[T]], model_dir: Path, cache_dir: Path | None) -> T | None:
    """The first wanted form of ``forms`` that loads (:meth:`Form.attempt`), or None when
    every wanted form fell back (a table without a published form, e.g. the streamed
    vocoder's).

    Args:
        forms: in order of preference.
        model_dir: the model directory (derived files go to ``cache_dir`` or beside it,
            :func:`.files.derived_files_dir`).
        cache_dir: ``EngineOptions.cache_dir``.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: the published form failed.
    """
    for form in forms:
        if not form.wanted:
            continue
        loaded = form.attempt(model_dir, cache_dir)
        if loaded is not None:
            return loaded
    return None
