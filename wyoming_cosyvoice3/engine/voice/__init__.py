"""Voice stage: reference clip -> voice prompt features, cached on disk.

Loads and resamples the clip (:mod:`.audio_io`), computes the speech tokens, speaker
embedding and prompt mel (:mod:`.prepare`), and keeps them in an on-disk cache keyed by the
clip, transcript, instruction and encoder files. Imports the top engine modules (constants,
errors, types, dsp, graphs) and no other stage.
"""
