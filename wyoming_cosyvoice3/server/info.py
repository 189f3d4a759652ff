"""The ``info`` answer to ``describe``: built from the runtime's current state, never blocking."""

from __future__ import annotations

from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

from .. import __version__
from .catalog import DEFAULT_ATTRIBUTION_NAME, DEFAULT_ATTRIBUTION_URL
from .model_loader import ModelState
from .protocol import first_line
from .runtime import ServerRuntime

PROGRAM_NAME = "cosyvoice3"
MODEL_DESCRIPTION = "Fun-CosyVoice3-0.5B on onnxruntime"


def build_info(runtime: ServerRuntime) -> Info:
    """Describe the program and every catalog voice.

    ``installed`` is true only for voices prepared for synthesis (so never while the model
    loads). The program itself is always ``installed`` (Home Assistant picks the first
    installed program); its description says whether the model is loading or failed.
    """
    status = runtime.loader.status()
    state = status.state
    slots = list(runtime.voices.values())
    if state is ModelState.READY:
        description = MODEL_DESCRIPTION
        problems = [slot.problem for slot in slots if slot.problem]
        if not any(slot.installed for slot in slots):
            description += f" (no voice is usable: {problems[0] if problems else 'none listed'})"
    elif state is ModelState.FAILED:
        description = f"{MODEL_DESCRIPTION} (unavailable: {first_line(str(status.error))})"
    else:
        description = f"{MODEL_DESCRIPTION} ({status.phase})"
    voices = [
        TtsVoice(
            name=slot.entry.name,
            description=slot.entry.description,
            attribution=Attribution(name=slot.entry.attribution_name,
                                    url=slot.entry.attribution_url),
            installed=state is ModelState.READY and slot.installed,
            version=None,
            languages=list(slot.entry.languages),
        )
        for slot in slots
    ]
    program = TtsProgram(
        name=PROGRAM_NAME,
        description=description,
        attribution=Attribution(name=DEFAULT_ATTRIBUTION_NAME, url=DEFAULT_ATTRIBUTION_URL),
        installed=True,
        version=__version__,
        voices=voices,
        supports_synthesize_streaming=runtime.settings.streaming,
    )
    return Info(tts=[program])
