"""Voice stage: reference clip -> voice prompt features, cached on disk.

Loads and resamples the clip (:mod:`.audio_io`), computes the speech tokens, speaker
embedding and prompt mel (:mod:`.encoders`), either in the calling thread or in the voice
encoder process (:mod:`.worker`), and keeps them in memory and in an on-disk cache keyed by the
clip, transcript, instruction and encoder files (:mod:`.prepare`). Imports the top engine
modules (constants, errors, options, istft, sessions) and no other stage.
"""
