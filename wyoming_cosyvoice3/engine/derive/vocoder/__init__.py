"""Derived form of the vocoder (HiFT): streamed with its convolution context, delay lines and
source phase carried as state (:mod:`.hift_stream`, made exact per call length by the rewrite of
:mod:`.hift_exact`)."""
