"""Flow stage: speech tokens -> mel frames (50 Hz, 80 bins).

The flow encoder and the cosine-schedule Euler solver with CFG over the DiT estimator
(:mod:`.solver`), speed resampling of the mel (:mod:`.melops`). Imports the top engine
modules and no other stage; derived estimators reach it through the model
(:mod:`..model`).
"""
