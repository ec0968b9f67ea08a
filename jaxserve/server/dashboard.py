"""GET /dashboard: one self-contained page (dashboard.html: inline CSS and JS, canvas plots, no build step, no
CDN) that polls GET /dashboard/data every second. The data is ServerMetrics.dashboard_snapshot(): the numbers
/metrics exports, as JSON, plus recent latency percentiles."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from jaxserve.server.state import server_of


def page() -> str:
    """Read per request (15 kB): an edited page shows on reload, and nothing is kept in a module global."""
    return resources.files("jaxserve.server").joinpath("dashboard.html").read_text(encoding="utf-8")


async def dashboard(request: Request) -> Response:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})


async def dashboard_data(request: Request) -> Response:
    return JSONResponse(server_of(request).metrics.dashboard_snapshot(), headers={"Cache-Control": "no-store"})
