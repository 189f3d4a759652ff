"""The optional voice page: add, hear and manage cloned voices from a browser.

Started by ``--http-port`` (off by default) on the Wyoming server's own event loop; see
``app.py`` for the routes and the safety rules, ``admin.py`` for how changes reach the running
server, ``store.py`` for how the catalog is written.
"""

from __future__ import annotations

from .app import WebServer, build_app

__all__ = ["WebServer", "build_app"]
