"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status they go with."""

from __future__ import annotations

from typing import Optional


class APIError(Exception):
    """A request the server refuses; `status` is the HTTP status, the rest fills OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002 (OpenAI's name)
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.headers = headers  # sent with the error (a 429's Retry-After)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: Optional[str] = None,  # noqa: A002
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)
