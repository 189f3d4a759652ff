"""Vocoder stage: mel frames -> 24 kHz samples.

The HiFT graph's runner, the streamed emission with the host iSTFT (:mod:`..istft`) and the rule
for when the vocoder runs, all in :mod:`.hift`. Imports the top engine modules and no other
stage.
"""
