"""The FastAPI app: TGI and OpenAI routes, probes, metrics, API key, payload limit and request metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import METRICS_CONTENT_TYPE

from . import admin, embeddings, openai, responses, router_worker, tgi, ui, utility
from . import lora as lora_routes
from .errors import APIError, ErrorKind, family_of_path
from .generation import ClientGone
from .openapi_doc import install_openapi
from .state import Phase, ServerState

log = logging.getLogger("server.api.access")

# Probes, scrapes and /info stay reachable without the API key (kubelet and Prometheus carry none).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/info", "/version", "/openapi.json"})
_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})


class APIMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would break disconnect detection and streaming): API key, payload
    size, HTTP request metrics and the access log line (route, status, duration; never bodies)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        cfg = state.config
        self._key = cfg.api_key.encode() if cfg.api_key else None
        self._ui = cfg.ui
        self._management = admin.ManagementGuard(cfg.api_key, cfg.admin_api_key, cfg.host)
        self._loopback = admin.is_loopback(cfg.host)

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None:
            return True
        token = admin.bearer_token(scope)
        return admin.matches(token, self._key) or self._management.is_admin(token)

    def _content_length(self, scope: Scope) -> int | None:
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit():
                return int(value)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status = 500
        started = False
        t0 = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        try:
            error = admin.host_refusal(scope, self._loopback)
            page = self._ui and ui.is_page_request(scope.get("method", ""), path)
            if error is not None:
                pass
            elif path in admin.MANAGEMENT_PATHS:
                error = admin.cross_site_refusal(scope) or self._management.refusal(scope)
            elif path not in OPEN_PATHS and not page and not self._authorized(scope):
                error = APIError(
                    ErrorKind.UNAUTHORIZED,
                    "Unauthorized: a valid API key is required (Authorization: Bearer)",
                )
            if error is None:
                length = self._content_length(scope)
                if length is not None and length > self.state.config.max_payload_bytes:
                    error = APIError(
                        ErrorKind.TOO_LARGE,
                        f"request body is larger than {self.state.config.max_payload_bytes} bytes",
                    )
            if error is not None:
                headers = {"WWW-Authenticate": "Bearer"} if error.kind is ErrorKind.UNAUTHORIZED else None
                await error.response(family_of_path(path), headers=headers)(scope, receive, send_wrapper)
            else:
                try:
                    await self.app(scope, receive, send_wrapper)
                except Exception as e:
                    # Answered here instead of by Starlette's ServerErrorMiddleware, which re-raises
                    # after its 500, so that uvicorn closes the connection: a client's next request on
                    # the same keep-alive connection would be reset.
                    if started:
                        raise
                    log.exception("unhandled error on %s", path)
                    err = APIError(ErrorKind.INCOMPLETE, f"internal error: {type(e).__name__}")
                    await err.response(family_of_path(path))(scope, receive, send_wrapper)
        finally:
            route_obj = scope.get("route")
            route = getattr(route_obj, "path", None) or "other"
            self.state.metrics.http_request(route, status)
            level = logging.DEBUG if path in _QUIET_PATHS else logging.INFO
            log.log(
                level, "%s %s %d %.1fms", scope.get("method"), route, status, (time.monotonic() - t0) * 1000
            )


def create_app(state: ServerState, load_on_startup: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load_on_startup and state.phase is Phase.LOADING and state.engine is None:
            state.start_loading()
        yield
        await state.shutdown()

    app = FastAPI(
        title="kubeinfer",
        version=tgi.VERSION,
        description="LLM inference server speaking the TGI and OpenAI wire formats.",
        lifespan=lifespan,
        # No Swagger UI or ReDoc: both load unpinned scripts from a CDN into a page on the playground's
        # origin. The API is described by /openapi.json (install_openapi below).
        docs_url=None,
        redoc_url=None,
        # Starlette's trailing-slash redirect builds an absolute Location from the Host header (an
        # open redirect for whoever sets Host): a path with an extra slash is a 404 instead.
        redirect_slashes=False,
    )
    app.state.server = state

    # HEAD answers like GET without a body (uvicorn drops it), for probes and load balancers.
    @app.get("/health", summary="Liveness: 200 while the engine loop is alive (also while loading)")
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        if state.alive:
            return JSONResponse({"status": "ok" if state.phase is not Phase.LOADING else "loading"})
        reason = state.load_error or (state.engine.error if state.engine else None)
        return JSONResponse({"status": "dead", "error": repr(reason)}, status_code=503)

    @app.get("/ready", summary="Readiness: 200 once loaded and warmed up; 503 while loading or draining")
    @app.head("/ready", include_in_schema=False)
    async def ready() -> Response:
        if state.ready:
            return JSONResponse({"status": "ready"})
        status = state.phase.value if state.alive else "dead"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics (vLLM and TGI names)")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    if state.task != "generate":  # a pooling model: generation routes 400, its own /v1/models and /info
        app.include_router(embeddings.guard_router)
    app.include_router(embeddings.router)
    app.include_router(tgi.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    if state.config.ui:
        app.include_router(ui.router)
    app.include_router(utility.router)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and methods answer in the route family's error shape, not FastAPI's `detail`.
        path = request.url.path
        if exc.status_code == 404:
            err = APIError(ErrorKind.NOT_FOUND, f"no route {request.method} {path}")
        elif exc.status_code == 405:
            err = APIError(ErrorKind.METHOD_NOT_ALLOWED, f"method {request.method} is not allowed on {path}")
        else:
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)
        return err.response(family_of_path(path), headers=dict(exc.headers) if exc.headers else None)

    app.include_router(router_worker.router)
    if state.config.engine.lora.allow_runtime_updating:
        app.include_router(lora_routes.router)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(family_of_path(request.url.path))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        err = APIError(ErrorKind.INCOMPLETE, f"internal error: {type(exc).__name__}")
        return err.response(family_of_path(request.url.path))

    app.add_middleware(APIMiddleware, state=state)  # type: ignore[arg-type]
    # Outermost, so that a browser's preflight is answered before the API key is asked for.
    cfg = state.config
    app.add_middleware(
        CORSMiddleware,  # type: ignore[arg-type]
        allow_origins=list(cfg.allowed_origins),
        allow_methods=list(cfg.allowed_methods),
        allow_headers=list(cfg.allowed_headers),
        allow_credentials=cfg.allow_credentials,
    )
    install_openapi(app, METRICS_CONTENT_TYPE, OPEN_PATHS)
    return app
