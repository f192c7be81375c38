"""Calibration: measure this machine on every rank of a gloo group (``autotp calibrate``) and fit a
profile. The measuring lives here, above the stages (it runs graphs on process groups); the fit and
the formulas it fits are :mod:`autotp.cost_model`'s."""
