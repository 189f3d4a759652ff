"""Wyoming protocol server over the CosyVoice3 engine (asyncio; engine work in threads).

Modules: ``settings`` (flags, environment, add-on options), ``catalog`` (voice YAML),
``runtime`` (model state, worker threads, concurrency), ``handler`` (one connection),
``speech`` / ``streams`` (one-shot and streaming requests), ``limits`` (resource bounds),
``protocol`` (bounded event reader),
``requests`` (text and voice checks), ``info`` (describe), ``cli`` (entry point),
``healthcheck`` (container health probe).
"""
