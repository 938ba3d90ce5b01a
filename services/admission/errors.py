"""Typed errors of the Kubernetes edge (tree drawn in ``services.admission``)."""

from __future__ import annotations


class AdmissionError(Exception):
    """Base of every error the admission package raises."""


class InvalidPod(AdmissionError):
    """The object is not a readable pod; the message names the JSON path of the bad field."""


class PolicyError(AdmissionError):
    """The pod's Tandem request is invalid; the message is written for the pod author."""


class InvalidClaim(AdmissionError):
    """A ``DeviceClaim`` is invalid; the message names the claim and the field (``spec.gpus``)."""


class ReviewError(AdmissionError):
    """The HTTP body is not an ``admission.k8s.io/v1`` AdmissionReview request."""


class BodyTooLarge(ReviewError):
    """The HTTP body is over the webhook's size limit (answered 413, not parsed)."""
