"""Errors of the voice page. Each becomes a JSON answer ``{"error": message}`` with its status.

Messages say what to change (they are shown to the user as they are).
"""

from __future__ import annotations


class PageError(Exception):
    """A request the page cannot carry out; ``status`` is the HTTP status of the answer."""

    status = 500


class BadRequest(PageError):
    """A field or the clip is unusable (400); the message names the field and the fix."""

    status = 400


class Forbidden(PageError):
    """The request came from another site or through an unexpected host name (403)."""

    status = 403


class NotFound(PageError):
    """No voice of that name (404)."""

    status = 404


class Conflict(PageError):
    """The name is taken, the voice is not editable here, or the catalog file is broken (409)."""

    status = 409


class TooLarge(PageError):
    """The upload is larger than ``--max-clip-bytes`` (413)."""

    status = 413


class Unavailable(PageError):
    """The model is not ready yet, or the server is busy (503)."""

    status = 503
