"""Wyoming protocol server over the CosyVoice3 engine (asyncio; engine work in threads).

Modules: ``settings`` (flags, environment, add-on options), ``catalog`` (voice YAML),
``runtime`` (model state, worker threads, concurrency), ``voice_slots`` (a voice as held and
prepared), ``handler`` (one connection),
``speech`` / ``streams`` (one-shot and streaming requests), ``limits`` (resource bounds),
``protocol`` (bounded event reader),
``requests`` (text and voice checks), ``info`` (describe), ``cli`` (entry point),
``healthcheck`` (container health probe), ``web`` (the optional voice page, ``--http-port``).
"""
