"""Errors as HTTP answers: APIError, and how the app answers it (in OpenAI's shape, or Anthropic's on its paths),
a body that fails validation, and a 404."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape, which OpenAI-compatible clients read."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's Messages API (its paths start so) answers errors in its own shape, its type named by the status.
ANTHROPIC_PATHS = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error"}


# Ollama's API answers errors as {"error": message}.
OLLAMA_PATHS = "/api/"


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape, which its clients read."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


class APIError(Exception):
    """An error answered with an OpenAI-style body, or Anthropic's on its API's paths."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self, path: str = "") -> JSONResponse:
        """The answer to a request for path."""
        if path.startswith(OLLAMA_PATHS):
            return JSONResponse({"error": self.message}, status_code=self.status)
        if path.startswith(ANTHROPIC_PATHS):
            return JSONResponse(anthropic_error_body(self.status, self.message), status_code=self.status)
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def validation_error(exc: RequestValidationError) -> APIError:
    """A body pydantic refused, as a 400 naming the first field at fault."""
    errors = exc.errors()
    # In a union each branch reports; a value of the right type that is wrong says more than the
    # other branches' type mismatches.
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    loc = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "missing":
        code = "missing_required_parameter"
    elif first["type"].endswith("_type"):
        code = "invalid_type"
    else:
        code = "invalid_value"
    # Leading with the chosen error; union branches' tags ("list[ContentPart]") are not field names.
    ordered = [first, *(e for e in errors if e is not first)][:3]
    details = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body' and '[' not in str(p)) or 'body'}: {e['msg']}"
        for e in ordered)
    return APIError(400, f"invalid request: {details}", param=loc[0] if loc else None, code=code)


def add_error_handlers(app: FastAPI) -> None:
    """Answer APIError, invalid bodies and Starlette's own HTTP errors (404, 405) with the error body."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
                        ).response(request.url.path)
