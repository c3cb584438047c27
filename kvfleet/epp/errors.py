"""Typed errors of the endpoint picker; each carries the HTTP status Envoy answers with.

The ext_proc server turns any :class:`EppError` into an ImmediateResponse with
``status`` and a JSON body ``{"error": {"code": ..., "type": ..., "message": ...}}``;
anything else becomes a 500 with a generic message (never a stack trace).
"""

from __future__ import annotations


class EppError(Exception):
    """Base: a request the picker cannot route. ``status`` is the HTTP status code."""

    status = 500
    kind = "internal_error"


class BadRequestError(EppError):
    """Unparsable JSON, missing fields, wrong types, unknown API path."""

    status = 400
    kind = "invalid_request_error"


class ForbiddenPathError(EppError):
    """A path the gateway never forwards (the engines' internal ``/kvfleet/`` API)."""

    status = 404
    kind = "not_found_error"


class MethodNotAllowedError(EppError):
    """An HTTP method the path does not take (inference is POST, model listing GET)."""

    status = 405
    kind = "method_not_allowed"


class BodyTooLargeError(BadRequestError):
    """The body exceeds ``max_body_bytes``."""

    kind = "request_too_large"


class UnknownModelError(EppError):
    """No pool serves the requested ``model``."""

    status = 404
    kind = "model_not_found"


class NoEndpointError(EppError):
    """Pools serve the model but no pod is ready."""

    status = 503
    kind = "no_ready_endpoint"


class SheddingError(EppError):
    """Every candidate pod is above the shedding threshold; retry later."""

    status = 429
    kind = "overloaded"


class UnknownPluginError(ValueError):
    """A scheduling plugin name that is not registered (the message lists the known names)."""


class DatastoreError(ValueError):
    """The pods/pools configuration is invalid."""
