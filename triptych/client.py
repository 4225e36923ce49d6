"""A client of a Triptych head's HTTP API (what `triptych generate / video / status` use).

    client = TriptychClient("http://head:30000", api_key="...")
    pngs = client.generate_images({"prompt": "a lighthouse", "size": "512x512", "seed": 1})
    pngs = client.edit_images({"prompt": "at night", "seed": 1}, Reference.of("photo.png"))
    job = client.create_video({"prompt": "waves", "num_frames": 33})
    for event in client.video_events(job["id"]): ...

It speaks HTTP only (no ZMQ, no access to workers), so it works against any head it can reach.
"""

from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class ClientError(Exception):
    """The head answered with an error (its message), or could not be reached."""


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a request's progress (head/triptych_head/api/progress.py)."""

    event: str
    data: dict[str, Any]


def iter_sse(lines: Iterable[str]) -> Iterator[Event]:
    """Parse `event:` / `data:` blocks separated by blank lines; comments (keep-alives) are skipped."""
    name, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield Event(name, json.loads("\n".join(data)))
            name, data = "message", list[str]()
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase


@dataclass(frozen=True)
class Reference:
    """An edit's reference image: a file's bytes (uploaded) or an http(s) URL (the server fetches it)."""

    data: bytes | None = None
    url: str | None = None
    name: str = "image.png"

    @classmethod
    def of(cls, image: str) -> Reference:
        """`image` as a user gives it: an http(s) URL, else a path to an image file."""
        if image.startswith(("http://", "https://")):
            return cls(url=image)
        try:
            return cls(data=Path(image).read_bytes(), name=Path(image).name)
        except OSError as exc:
            raise ClientError(f"image: cannot read {image}: {exc.strerror or exc}") from None

    def form(self, body: dict[str, Any]) -> dict[str, Any]:
        """httpx keyword arguments for a POST /v1/images/edits of `body` with this reference."""
        fields = {k: _form_text(v) for k, v in body.items()}
        if self.url is not None:
            return {"data": {**fields, "image": self.url}}
        mime = mimetypes.guess_type(self.name)[0] or "application/octet-stream"
        return {"data": fields, "files": {"image": (self.name, self.data, mime)}}


def _form_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool | list | dict) else str(value)


def _pngs(response: httpx.Response) -> list[bytes]:
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]


class TriptychClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ClientError(f"cannot reach {self.url}: {exc}") from None
        if response.status_code >= 400:
            raise ClientError(f"{response.status_code}: {_error_text(response)}")
        return response

    def _events(self, method: str, path: str, **kwargs: Any) -> Iterator[Event]:
        try:
            with self.http.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ClientError(f"{response.status_code}: {_error_text(response)}")
                yield from iter_sse(response.iter_lines())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never connected: nothing was lost
            raise ClientError(f"cannot reach {self.url}: {exc}") from None
        except httpx.HTTPError as exc:
            raise ClientError(f"lost the connection to {self.url}: {exc}") from None

    def generate_images(self, body: dict[str, Any]) -> list[bytes]:
        """The PNGs of POST /v1/images/generations."""
        return _pngs(self._request("POST", "/v1/images/generations", json={**body, "response_format": "b64_json"}))

    def stream_images(self, body: dict[str, Any]) -> Iterator[Event]:
        """POST /v1/images/generations with stream: its progress events, the last `completed` or `error`."""
        return self._events("POST", "/v1/images/generations", json={**body, "stream": True})

    def edit_images(self, body: dict[str, Any], image: Reference) -> list[bytes]:
        """The PNGs of POST /v1/images/edits: `body` (prompt, size, seed, ...) applied to `image`."""
        return _pngs(self._request("POST", "/v1/images/edits", **image.form({**body, "response_format": "b64_json"})))

    def stream_edits(self, body: dict[str, Any], image: Reference) -> Iterator[Event]:
        """POST /v1/images/edits with stream: its progress events, the last `completed` or `error`."""
        return self._events("POST", "/v1/images/edits", **image.form({**body, "stream": True}))

    def create_video(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._request("POST", "/v1/videos", json=body).json())

    def video(self, video_id: str) -> dict[str, Any]:
        return dict(self._request("GET", f"/v1/videos/{video_id}").json())

    def video_events(self, video_id: str) -> Iterator[Event]:
        return self._events("GET", f"/v1/videos/{video_id}/events")

    def cancel_video(self, video_id: str) -> dict[str, Any]:
        return dict(self._request("DELETE", f"/v1/videos/{video_id}").json())

    def save_video(self, video_id: str, path: Path) -> int:
        """Write the job's MP4 to `path`; returns its size in bytes."""
        content = self._request("GET", f"/v1/videos/{video_id}/content").content
        path.write_bytes(content)
        return len(content)

    def pipeline(self) -> dict[str, Any]:
        return dict(self._request("GET", "/v1/pipeline").json())
