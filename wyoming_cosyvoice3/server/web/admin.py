"""Adding, editing and deleting voices at run time, and listing them for the page.

A change is: check the fields and the clip (``uploads.py``), store the clip, let the engine
prepare the voice (the same call the catalog's voices go through at start, so a clip the
engine refuses is reported to the user and nothing is saved), write ``voices.yaml``
atomically (``store.py``), then have the voice table re-read every catalog exactly as the
server does at start and swap itself in one assignment (:meth:`.voice_table.VoiceTable.reload`:
the page never writes the table itself). Voices that did not change keep their prepared
prompts; a request already running keeps the voice it started with. ``describe`` reads the
new table at once.

Changes are serialised by one ``asyncio.Lock`` (and the catalog file lock of ``store.py``),
so two tabs saving at once cannot interleave. Only voices whose entry comes from
``<first data dir>/voices.yaml`` can be edited or deleted; built-in voices and ``--voices``
entries are read-only on the page.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import soundfile as sf

from ...engine.errors import CosyVoiceError, VoiceError
from ..catalog import VoiceEntry, default_catalog_path, resolve_clip
from ..engine_port import Engine
from ..machine import AUTO
from ..model_loader import ModelLoader, ModelState
from ..settings import Settings
from ..voice_table import VoiceSlot, VoiceTable
from .errors import BadRequest, Conflict, NotFound, PageError, Unavailable
from .store import CatalogStore, Items
from .uploads import CheckedClip, VoiceFields, VoiceForm, check_clip, check_name, parse_fields

_LOGGER = logging.getLogger(__name__)

MAX_CACHED_DURATIONS = 1024
"""Clip lengths remembered (by path, mtime and size) so the list does not reopen every clip."""


def voice_mode(entry: VoiceEntry) -> str:
    """``instruct`` (an instruction is set; the transcript is then not part of the prompt),
    ``zero-shot`` (a transcript) or ``cross-lingual`` (neither); see README, Voices."""
    if entry.instruction:
        return "instruct"
    return "zero-shot" if entry.transcript else "cross-lingual"


class VoiceAdmin:
    """The page's view of the voices and the model's state.

    Args:
        settings: the resolved settings (data dirs, ``--preset``, ``max_clip_bytes``).
        loader: the model loader (state, engine, preset).
        voices: the voice table (reloaded through its own methods on every change).
    """

    def __init__(self, settings: Settings, loader: ModelLoader, voices: VoiceTable) -> None:
        self.settings = settings
        self.loader = loader
        self.voices = voices
        self.store = CatalogStore(settings.data_dirs[0]) if settings.data_dirs else None
        self._lock = asyncio.Lock()
        self._builtin_source = str(default_catalog_path())
        self._durations: dict[tuple[str, int, int], float] = {}

    @property
    def max_clip_bytes(self) -> int:
        return self.settings.limits.max_clip_bytes

    # --- reading ---------------------------------------------------------------------------

    def editable(self, slot: VoiceSlot) -> bool:
        """True for voices defined in the first data dir's ``voices.yaml``."""
        return self.store is not None and slot.entry.source == str(self.store.path)

    async def listing(self) -> dict[str, Any]:
        """The model state and every voice, as the page shows them (JSON-ready)."""
        slots = list(self.voices.values())
        durations = await asyncio.to_thread(self._clip_durations, slots)
        default = self.voices.default()
        status = self.loader.status()
        return {
            "state": status.state.value,
            "phase": status.phase,
            "error": str(status.error) if status.error is not None else None,
            "catalog": str(self.store.path) if self.store is not None else None,
            "default_voice": default.entry.name if default is not None else None,
            "max_clip_bytes": self.max_clip_bytes,
            "preset": self.preset_info(),
            "voices": [self.describe_slot(slot, durations.get(slot.entry.name))
                       for slot in slots],
        }

    def preset_info(self) -> dict[str, Any]:
        """The preset requests run with, whether ``--preset auto`` chose it, and its
        prediction (:meth:`.machine.PresetChoice.to_json`; None before the choice or when a
        preset was given)."""
        loader = self.loader
        auto = self.settings.preset == AUTO
        choice = loader.preset_choice
        return {
            "name": loader.preset if not auto or choice is not None else None,
            "auto": auto,
            "choice": choice.to_json() if choice is not None else None,
        }

    def describe_slot(self, slot: VoiceSlot, clip_s: float | None = None) -> dict[str, Any]:
        """One voice as JSON: fields, mode, state (installed / why disabled), clip length."""
        entry = slot.entry
        ready = self.loader.state is ModelState.READY
        source = "built-in" if entry.source == self._builtin_source else entry.source
        return {
            "name": entry.name,
            "description": entry.description,
            "languages": list(entry.languages),
            "mode": voice_mode(entry),
            "transcript": entry.transcript,
            "instruction": entry.instruction,
            "installed": ready and slot.installed,
            "problem": slot.problem,
            "clip_s": round(clip_s, 2) if clip_s is not None else None,
            "source": source,
            "editable": self.editable(slot),
        }

    async def describe_one(self, name: str) -> dict[str, Any]:
        """One voice as JSON (see :meth:`describe_slot`), with its clip length."""
        slot = self._slot(name)
        durations = await asyncio.to_thread(self._clip_durations, [slot])
        return self.describe_slot(slot, durations.get(name))

    def _clip_durations(self, slots: list[VoiceSlot]) -> dict[str, float]:
        result: dict[str, float] = {}
        for slot in slots:
            try:
                path = resolve_clip(slot.entry)
                stat = path.stat()
                key = (str(path), stat.st_mtime_ns, stat.st_size)
                if key not in self._durations:
                    if len(self._durations) >= MAX_CACHED_DURATIONS:
                        self._durations.clear()
                    info = sf.info(str(path))
                    self._durations[key] = info.frames / info.samplerate
                result[slot.entry.name] = self._durations[key]
            except (ValueError, OSError, RuntimeError, sf.LibsndfileError):
                continue  # not found or unreadable: the slot's problem says so
        return result

    def clip_path(self, name: str) -> Path:
        """The resolved reference clip of a voice (for listening to it on the page)."""
        slot = self._slot(name)
        try:
            return resolve_clip(slot.entry)
        except ValueError as err:
            raise NotFound(str(err)) from err

    # --- changing --------------------------------------------------------------------------

    async def add(self, form: VoiceForm) -> dict[str, Any]:
        """Add a voice from a form; returns its JSON.

        Raises:
            BadRequest, TooLarge, Conflict, Unavailable: see :mod:`.errors`.
        """
        store = self._require_store()
        fields = parse_fields(form.fields)
        if form.clip is None:
            raise BadRequest("no clip was sent: choose an audio file or record one")
        engine = self._require_ready()
        async with self._lock:
            if fields.name in self.voices:
                existing = self.voices[fields.name].entry
                raise Conflict(f"a voice named {fields.name!r} exists already (from "
                               f"{existing.source}); choose another name, or edit that voice")
            clip = await asyncio.to_thread(check_clip, form.clip, form.clip_label,
                                           self.max_clip_bytes)
            relative = await self._store_and_check(engine, store, fields, clip)

            def change(items: Items) -> Items:
                if _find(items, fields.name):
                    raise Conflict(f"{store.path} already has a voice named {fields.name!r}")
                return [*items, fields.apply({}, relative)]

            await self._write(store, change, relative)
            await self._reload(engine)
        return await self.describe_one(fields.name)

    async def edit(self, name: str, form: VoiceForm) -> dict[str, Any]:
        """Change a voice's description, languages, transcript, instruction and/or clip."""
        store = self._require_store()
        fields = parse_fields(form.fields, name=check_name(name))
        engine = self._require_ready()
        async with self._lock:
            slot = self._editable_slot(name)
            old_clip = slot.entry.clip
            if form.clip is not None:
                clip = await asyncio.to_thread(check_clip, form.clip, form.clip_label,
                                               self.max_clip_bytes)
                relative = await self._store_and_check(engine, store, fields, clip)
            else:
                relative = old_clip
                try:
                    path = await asyncio.to_thread(resolve_clip, slot.entry)
                except ValueError as err:
                    raise BadRequest(f"{err}; upload a new clip") from err
                await self._check_voice(engine, path, fields)

            def change(items: Items) -> Items:
                index = _find(items, name)
                if not index:
                    raise NotFound(f"{store.path} no longer lists {name!r}; reload the page")
                items[index[-1]] = fields.apply(items[index[-1]], relative)
                return items

            items = await self._write(store, change, relative if relative != old_clip else None)
            if relative != old_clip:
                await asyncio.to_thread(store.remove_clip_if_unused, old_clip, items)
            await self._reload(engine)
        return await self.describe_one(name)

    async def delete(self, name: str) -> None:
        """Remove a voice from ``voices.yaml`` and delete its page-managed clip."""
        store = self._require_store()
        check_name(name)
        if self.loader.state is ModelState.LOADING:  # the loader thread owns the voices
            raise Unavailable("the model is still loading; delete the voice once it is ready")
        async with self._lock:
            self._editable_slot(name)
            removed: list[Any] = []

            def change(items: Items) -> Items:
                removed.extend(item for item in items
                               if isinstance(item, dict) and item.get("name") == name)
                if not removed:
                    raise NotFound(f"{store.path} no longer lists {name!r}; reload the page")
                return [item for item in items if not any(item is r for r in removed)]

            items = await self._write(store, change, None)
            for item in removed:
                await asyncio.to_thread(store.remove_clip_if_unused, item.get("clip"), items)
            engine = self.loader.engine
            if engine is not None:
                await self._reload(engine)
            else:  # the model failed to load: nothing is prepared, just drop the voice
                self.voices.drop(name)
        _LOGGER.info("Voice %r deleted on the voice page", name)

    # --- steps -----------------------------------------------------------------------------

    async def _store_and_check(self, engine: Engine, store: CatalogStore, fields: VoiceFields,
                               clip: CheckedClip) -> str:
        """Write the clip under ``clips/`` and let the engine prepare it; remove it again
        when the engine refuses it. Returns the path relative to the data dir."""
        relative = await asyncio.to_thread(store.write_clip, fields.name, clip.extension,
                                           clip.data)
        try:
            await self._check_voice(engine, store.data_dir / relative, fields)
        except BaseException:
            (store.data_dir / relative).unlink(missing_ok=True)
            raise
        return relative

    async def _check_voice(self, engine: Engine, path: Path, fields: VoiceFields) -> None:
        try:
            await asyncio.to_thread(engine.prepare_voice, path, fields.transcript,
                                    fields.instruction, fields.name)
        except VoiceError as err:
            raise BadRequest(str(err)) from err
        except CosyVoiceError as err:
            raise PageError(f"the engine could not prepare the voice: {err}") from err

    async def _write(self, store: CatalogStore, change: Any, new_clip: str | None) -> Items:
        try:
            items: Items = await asyncio.to_thread(store.update, change)
        except BaseException:
            if new_clip is not None:
                (store.data_dir / new_clip).unlink(missing_ok=True)
            raise
        return items

    async def _reload(self, engine: Engine) -> None:
        """Re-read every catalog as at start; keep the prompts of unchanged voices."""
        await asyncio.to_thread(self.voices.reload, engine)

    # --- lookups ---------------------------------------------------------------------------

    def _require_store(self) -> CatalogStore:
        if self.store is None:
            raise Conflict("the server has no --data-dir to save voices in; start it with one")
        return self.store

    def _require_ready(self) -> Engine:
        try:
            return self.loader.require_ready()
        except CosyVoiceError as err:
            raise Unavailable(f"{err}; voices can be added once the model is ready") from err

    def _slot(self, name: str) -> VoiceSlot:
        slot = self.voices.get(check_name(name))
        if slot is None:
            raise NotFound(f"there is no voice named {name!r}; reload the page")
        return slot

    def _editable_slot(self, name: str) -> VoiceSlot:
        slot = self._slot(name)
        if not self.editable(slot):
            where = "built-in" if slot.entry.source == self._builtin_source else slot.entry.source
            raise Conflict(f"voice {name!r} is defined in {where}, which the page does not "
                           "change; add a voice under another name instead")
        return slot


def _find(items: Items, name: str) -> list[int]:
    """Indexes of the catalog items named ``name``."""
    return [i for i, item in enumerate(items) if isinstance(item, dict)
            and item.get("name") == name]
