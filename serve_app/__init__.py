"""kvscale's Ray Serve app: `serve run serve_app:app` (defaults) or `serve run serve_app/config.yaml`."""
from __future__ import annotations

from serve_app.app import build_app

app = build_app()

__all__ = ["app", "build_app"]
