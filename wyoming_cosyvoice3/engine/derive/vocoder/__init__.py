"""Derived forms of the vocoder (HiFT): phase-carrying (:mod:`.hift_phase`) and streamed with
its convolution context carried as state (:mod:`.hift_stream`)."""
