"""Wyoming protocol server over the CosyVoice3 engine (asyncio; engine work in threads).

Modules: ``settings`` (flags, environment, add-on options, resource limits), ``catalog``
(voice YAML), ``engine_port`` (the ``Engine`` protocol: every engine call the server makes,
how the model is found and loaded), three parts: ``model_loader`` (model state, download
retry, preset choice, warm-up), ``voice_table`` (the voices; their only writer) and ``runner``
(worker threads, admission, cancellation), which ``runtime`` wires together with the
connection count; ``handler`` (one connection), ``protocol`` (the wire: bounded event reader, text
and voice checks, the write side), ``speech`` / ``streams`` (one-shot and streaming requests),
``preroll`` (the piece gate), ``info`` (describe), ``cli`` (entry point), ``healthcheck``
(container health probe), ``web`` (the optional voice page, ``--http-port``).
"""
