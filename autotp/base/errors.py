"""Exceptions autotp raises on bad input, each naming the problem and the fix."""

from __future__ import annotations


class AutoTPError(RuntimeError):
    """Base class of autotp's own errors."""


class CaptureError(AutoTPError):
    """The model could not be traced into a graph (e.g. data-dependent control flow)."""


class PlanError(AutoTPError):
    """No valid plan exists for the request (e.g. an infeasible memory budget)."""


class PlanMismatchError(AutoTPError):
    """A saved or hand-edited plan does not match the model it is applied to."""


class UnsupportedOpError(AutoTPError):
    """``strict=True`` and some ops have no sharding rule (they would run replicated)."""


class AgreementError(AutoTPError):
    """The ranks of a tensor-parallel group disagree (graph, options, weights or input shapes).

    Every rank raises it with the same message, naming the ranks and what differs.
    """


class RankTimeoutError(AgreementError):
    """Some ranks did not reach an autotp exchange within ``agreement_timeout_s`` (named in the message)."""


class TracedValueError(AutoTPError):
    """A non-tensor argument was called with another value than the one baked into the traced graph."""


class InputShapeError(AutoTPError, ValueError):
    """A tensor-parallel model was called with an input size its traced graph cannot take."""


class UnsupportedReleaseError(AutoTPError):
    """The installed release of a dependency (transformers) is outside the releases autotp is tested on."""


class CheckpointError(AutoTPError, ValueError):
    """A checkpoint that cannot be read into the model: names the tensor, the file and what to do."""


class UnsupportedQuantizationError(AutoTPError):
    """A quantized weight (a torchao tensor subclass) of a scheme autotp does not split: names it and what is."""


class RuntimeModeError(AutoTPError, ValueError):
    """A runtime mode asked for by name cannot run here (no CUDA device, no C++ compiler, training): says what works."""


class UnsupportedModelError(AutoTPError):
    """A model family whose generation state autotp does not hold (e.g. an SSM or convolution state, not a
    per-head KV cache): names the family, what it keeps and what works instead."""
