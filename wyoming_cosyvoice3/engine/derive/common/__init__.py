"""What every derivation shares: the graph index (:mod:`.graph`), the derive-once cache files
(:mod:`.files`) and the derive-or-fall-back helper (:mod:`.forms`)."""
