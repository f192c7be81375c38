"""Calibration: measure this machine on every rank of a gloo group (``autotp calibrate``) and fit a
profile. The measuring lives here, above the stages (it runs graphs on process groups); the fit and
the formulas it fits are :mod:`autotp.cost_model`'s. A model's own measurement lives here too: the rows its
router sends to each expert on calibration data (:mod:`.expert_load`, ``autotp.measure_expert_load``)."""
