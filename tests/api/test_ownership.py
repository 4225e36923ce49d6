"""Whose video jobs a key sees (head/triptych_head/api/ownership.py): with --api-keys-file, a key sees
the jobs of its tenant (`tenant=NAME`) or, without the option, its own; another owner's job answers
404 on every route, as one that does not exist, on this head and on any other sharing the store.
Before, any key listed, read, downloaded and deleted every other key's jobs.

In-process over HTTP with a scripted backend; two heads are two apps on one result store."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.api.test_http_api import ScriptedBackend, wait_for
from triptych.families import ModelInfo
from triptych.params import GenerationParams
from triptych_head.api.app import create_app
from triptych_head.api.auth import APIKeyError, APIKeys, parse_entries
from triptych_head.api.context import HeadContext
from triptych_head.results import ResultStore

KEYS = "sk-acme-old tenant=acme\nsk-acme-new tenant=acme\nsk-bob\nsk-eve\n"
VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 5, "num_inference_steps": 2}
MISSING = "video_" + "0" * 32  # a job id no head made


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextmanager
def head(tmp_path: Path, keys: str | None = KEYS) -> Iterator[TestClient]:
    """A head over the result store in `tmp_path`; `keys`: its keys file (None: the API is open)."""
    api_keys = None
    if keys is not None:
        (tmp_path / "keys").write_text(keys)
        api_keys = APIKeys(tmp_path / "keys")
    model = ModelInfo("tiny", "WanPipeline", "video", 4, 3.5)
    ctx = HeadContext(ScriptedBackend(), model, tmp_path, CollectorRegistry(), api_keys=api_keys)
    with TestClient(create_app(ctx)) as client:
        yield client


def routes(client: TestClient, job_id: str, key: str) -> dict[str, Any]:
    """Every route that names the job, as `key` calls it: status, events, content, and DELETE last."""
    calls = {
        "get": client.get(f"/v1/videos/{job_id}", headers=auth(key)),
        "events": client.get(f"/v1/videos/{job_id}/events", headers=auth(key)),
        "content": client.get(f"/v1/videos/{job_id}/content", headers=auth(key)),
        "delete": client.delete(f"/v1/videos/{job_id}", headers=auth(key)),
    }
    return {name: (r.status_code, r.json()["error"]["message"].replace(job_id, "ID")) for name, r in calls.items()}


def listed(client: TestClient, key: str) -> list[str]:
    return [job["id"] for job in client.get("/v1/videos", headers=auth(key)).json()["data"]]


def test_a_key_s_tenant_is_its_owner_and_a_key_without_one_owns_its_own() -> None:
    old, new, bob, eve = parse_entries(KEYS)
    assert old.owner == new.owner == "tenant:acme"
    assert bob.owner.startswith("key:") and eve.owner.startswith("key:") and bob.owner != eve.owner
    assert "sk-bob" not in bob.owner  # a digest, never the key itself


@pytest.mark.parametrize("name", ["", "-acme", "a" * 65, "acme/team", "acmé"])
def test_a_tenant_name_that_cannot_be_one_stops_the_head_naming_the_line(tmp_path: Path, name: str) -> None:
    (tmp_path / "keys").write_text(f"sk-ok\nsk-bad tenant={name}\n")
    with pytest.raises(APIKeyError, match=r"line 2: tenant=.* must be 1-64 letters, digits"):
        APIKeys(tmp_path / "keys")


def test_an_unknown_option_names_tenant_among_the_options(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("sk-ok team=acme\n")
    with pytest.raises(APIKeyError, match=r"unknown option 'team' \(the options are max_priority=LEVEL, tenant=NAME"):
        APIKeys(tmp_path / "keys")


def test_another_owner_s_job_is_a_404_on_every_route_as_a_job_that_does_not_exist(tmp_path: Path) -> None:
    with head(tmp_path) as c:
        r = c.post("/v1/videos", json=VIDEO, headers=auth("sk-bob"))
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        wait_for(c, job_id, "completed", headers=auth("sk-bob"))
        assert listed(c, "sk-eve") == [] and listed(c, "sk-acme-old") == []
        missing = routes(c, MISSING, "sk-eve")
        assert {status for status, _ in missing.values()} == {404}
        assert routes(c, job_id, "sk-eve") == missing  # nothing tells it apart from a job never made
        assert listed(c, "sk-bob") == [job_id]  # DELETE by eve removed nothing
        content = c.get(f"/v1/videos/{job_id}/content", headers=auth("sk-bob"))
        assert content.status_code == 200 and content.content.startswith(b"\x00\x00\x00")  # an MP4


def test_keys_of_one_tenant_share_its_jobs_on_every_head_and_a_job_keeps_its_owner_in_the_store(
    tmp_path: Path,
) -> None:
    with head(tmp_path) as first:
        job_id = first.post("/v1/videos", json=VIDEO, headers=auth("sk-acme-old")).json()["id"]
        wait_for(first, job_id, "completed", headers=auth("sk-acme-new"))  # the tenant's other key
        assert listed(first, "sk-acme-new") == [job_id]
    stored = ResultStore(tmp_path).load_job(job_id)
    assert stored is not None and stored.owner == "tenant:acme"
    with head(tmp_path) as second:  # another head (or the next one) over the same store
        assert routes(second, job_id, "sk-bob") == routes(second, MISSING, "sk-bob")
        assert second.get(f"/v1/videos/{job_id}", headers=auth("sk-acme-new")).json()["status"] == "completed"
        assert second.delete(f"/v1/videos/{job_id}", headers=auth("sk-acme-new")).status_code == 200
    assert ResultStore(tmp_path).load_job(job_id) is None


def test_with_the_api_open_every_request_sees_every_job_and_its_jobs_stay_everyone_s(tmp_path: Path) -> None:
    """No keys file: no owner. Such a job (or one saved before owners were kept) is every key's once
    keys are configured, as it was."""
    with head(tmp_path, keys=None) as c:
        job_id = c.post("/v1/videos", json=VIDEO).json()["id"]
        wait_for(c, job_id, "completed")
        assert listed(c, "anything") == [job_id]
    with head(tmp_path) as keyed:
        assert keyed.get(f"/v1/videos/{job_id}", headers=auth("sk-eve")).json()["status"] == "completed"


@contextmanager
def image_head(tmp_path: Path) -> Iterator[tuple[TestClient, HeadContext]]:
    """A FLUX head with KEYS whose /v1/pipeline lists every request this head has in flight."""
    (tmp_path / "keys").write_text(KEYS)
    backend = ScriptedBackend()
    model = ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5)
    ctx = HeadContext(backend, model, tmp_path, CollectorRegistry(), api_keys=APIKeys(tmp_path / "keys"))
    ctx.pipeline_view = lambda: {"roles": {}, "requests": [{"id": rid} for rid in sorted(ctx.active)]}
    with TestClient(create_app(ctx)) as client:
        yield client, ctx


def test_an_image_url_holds_a_random_part_beyond_its_request_id(tmp_path: Path) -> None:
    """The request id shows (the owner's /v1/pipeline, logs); the URL is not made from it alone."""
    with image_head(tmp_path) as (c, _):
        body = {"prompt": "fox", "size": "16x16", "response_format": "url", "n": 2}
        urls = [d["url"] for d in c.post("/v1/images/generations", json=body, headers=auth("sk-bob")).json()["data"]]
        names = [url.rsplit("/", 1)[-1] for url in urls]
        assert [re.fullmatch(r"img_[0-9a-f]{32}-(\d)-[0-9a-f]{32}\.png", n) is not None for n in names] == [True] * 2
        assert len({n.split("-")[2] for n in names}) == 2  # each image its own secret
        assert c.get(urls[0], headers=auth("sk-bob")).content.startswith(b"\x89PNG")


def test_a_video_s_file_is_served_by_its_owner_s_content_route_alone(tmp_path: Path) -> None:
    with head(tmp_path) as c:
        job_id = c.post("/v1/videos", json=VIDEO, headers=auth("sk-bob")).json()["id"]
        wait_for(c, job_id, "completed", headers=auth("sk-bob"))
        assert c.get(f"/v1/files/videos/{job_id}.mp4", headers=auth("sk-eve")).status_code == 404
        assert c.get(f"/v1/files/videos/{job_id}.mp4", headers=auth("sk-bob")).status_code == 404
        assert c.get(f"/v1/videos/{job_id}/content", headers=auth("sk-bob")).status_code == 200


def test_the_pipeline_view_lists_the_caller_s_own_requests(tmp_path: Path) -> None:
    with image_head(tmp_path) as (c, ctx):
        ctx.admit("img_bob", GenerationParams(prompt="x", width=16, height=16), owner=parse_entries(KEYS)[2].owner)
        ctx.admit("img_acme", GenerationParams(prompt="x", width=16, height=16), owner=parse_entries(KEYS)[0].owner)

        def seen(key: str) -> list[str]:
            return [r["id"] for r in c.get("/v1/pipeline", headers=auth(key)).json()["requests"]]

        assert seen("sk-bob") == ["img_bob"]
        assert seen("sk-acme-new") == ["img_acme"]  # its tenant's
        assert seen("sk-eve") == []
