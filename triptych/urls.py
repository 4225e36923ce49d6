"""A URL as logs and error messages show it (webhook targets, the OTLP collector, a reference image):
never its user part (`user:password@`) or its query (a presigned URL's signature, a `?token=`), which
are credentials as often as not."""

from __future__ import annotations

import urllib.parse


def shown_url(url: str) -> str:
    """Scheme, host, port and path, without a user part, a query or a fragment. A URL that does not
    parse (an unclosed `[`) shows as its scheme alone: its text may hold anything."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number, a host urllib cannot read
        scheme = url.partition(":")[0] if "://" in url else ""
        return f"{scheme}://(a URL that does not parse)"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}{parts.path}"
