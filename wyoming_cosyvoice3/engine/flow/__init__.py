"""Flow stage: speech tokens -> mel frames (50 Hz, 80 bins).

One text piece's flow is a :class:`.stream.MelStream` (chunk schedule, chunk-causal or
full-attention choice, per-piece history); the flow's numerics are :mod:`.solver`: the
full-attention flow (flow encoder, exported DiT), the chunk-causal flow with its prompt and
history key/value caches, and the one Euler/CFG solver both run. The mel's speed resampling
is :class:`.stream.SpeedResampler`. Imports the top engine modules and no other stage;
derived estimators reach it through the model (:mod:`..model`).
"""
