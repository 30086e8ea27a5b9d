"""The one error hierarchy of Mixdesk.

``MixdeskError`` is the base of every error Mixdesk raises on purpose. ``UserError``
is what a user can cause (a bad file, a wrong adapter, a bad request, a hostile
value): it carries a message meant for that user, and the HTTP layer answers it
with a 4xx (``code``, ``type`` mirror llama-server's error types); ``HttpError`` is
what the HTTP layer itself refuses, with any status. Anything else
that escapes (an ``IndexError`` from numpy, say) is a bug: a 500 with a logged
traceback, never dressed up as the user's fault.

``UserError`` is deliberately not a ``ValueError``: an ``except ValueError`` around a
call would also swallow numpy's and the standard library's own ValueErrors (bugs) and
report them as the user's fault. Catch ``UserError``.
"""

from __future__ import annotations

from typing import Any


class MixdeskError(Exception):
    """Base of every error Mixdesk raises on purpose."""


class UserError(MixdeskError):
    """Something the user (or a client) did that Mixdesk refuses, with the reason."""

    code = 400
    type = "invalid_request_error"


class EngineError(UserError):
    """A request the engine (or its adapter registry) refuses; ``type`` and ``code``
    mirror llama-server's error types."""

    def __init__(self, message: str, type: str = "invalid_request_error", code: int = 400):
        super().__init__(message)
        self.type, self.code = type, code


class HttpError(MixdeskError):
    """A refusal the HTTP API answers with its own status and llama-server's error type:
    ``{"error": {"code", "message", "type", **extra}}`` (core/http/responses.error_body).
    Not every one is the client's fault (503 "server busy"), so it is a MixdeskError
    beside UserError, not under it; the API answers a UserError with a 400."""

    def __init__(
        self, message: str, code: int = 400, type: str = "invalid_request_error", **extra: Any
    ):
        super().__init__(message)
        self.message, self.code, self.type, self.extra = message, code, type, extra
