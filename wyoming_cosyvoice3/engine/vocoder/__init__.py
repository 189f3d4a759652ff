"""Vocoder stage: mel frames -> 24 kHz samples.

The HiFT graph, the host iSTFT and the streaming emission rule (:mod:`.hift`). Imports the
top engine modules and no other stage.
"""
