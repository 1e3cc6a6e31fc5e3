"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status they go with.

A message that quotes what the client sent quotes it through `echo`, which shortens it: an error must not cost
the server (or send back) a copy of a megabyte-long model name. `APIError` also shortens the whole message and
`param`, so a message built below the serving layer (ttftc.llm's ParamError quotes the value it refuses) is
bounded too.
"""

from __future__ import annotations

from typing import Any, Optional

ECHO_CHARS = 100  # of a client's value quoted in an error message
MESSAGE_CHARS = 1000  # of a whole error message: enough for any message the server writes itself


def shorten(text: str, limit: int = ECHO_CHARS) -> str:
    """`text`, or its first `limit` characters followed by how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


def echo(value: Any) -> str:
    """A client's value as an error message quotes it: its repr, shortened."""
    return shorten(repr(value))


class APIError(Exception):
    """A request the server refuses; `status` is the HTTP status, the rest fills OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002 (OpenAI's name)
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        message = shorten(message, MESSAGE_CHARS)
        super().__init__(message)
        self.headers = headers  # sent with the error (a 429's Retry-After)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else shorten(param)
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: Optional[str] = None,  # noqa: A002
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)
