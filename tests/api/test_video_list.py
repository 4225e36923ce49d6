"""GET /v1/videos answers as OpenAI lists videos: a page (`data`, `first_id`, `last_id`, `has_more`)
of the caller's jobs, newest first unless `order=asc`, `limit` at a time, `after` the previous page's
last job. Every head lists every head's jobs (tests/s3/test_shared_results.py); a listing re-reads
only the jobs whose JSON changed."""

from __future__ import annotations

import time

import pytest

from tests.api.test_http_api import ScriptedBackend, make_client, wait_for
from triptych.client import TriptychClient
from triptych_head.api.schemas import VideoJob
from triptych_head.api.video_list import StoredJobIndex
from triptych_head.results import ResultStore

VIDEO = {"prompt": "waves", "size": "32x16", "num_frames": 1, "num_inference_steps": 1}


def _made(client, count: int) -> list[str]:
    ids = [client.post("/v1/videos", json={**VIDEO, "seed": i}).json()["id"] for i in range(count)]
    for job_id in ids:
        wait_for(client, job_id, "completed")
    return ids


def _newest_first(client, ids: list[str]) -> list[str]:
    created = {job_id: client.get(f"/v1/videos/{job_id}").json()["created_at"] for job_id in ids}
    return sorted(ids, key=lambda job_id: (created[job_id], job_id), reverse=True)


def test_pages_follow_one_another_through_after_until_has_more_is_false(tmp_path):
    with make_client(ScriptedBackend(), tmp_path) as c:
        ids = _made(c, 5)
        pages, after = [], None
        while True:
            r = c.get("/v1/videos", params={"limit": 2, **({"after": after} if after else {})})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and len(body["data"]) <= 2
            assert body["first_id"] == body["data"][0]["id"] and body["last_id"] == body["data"][-1]["id"]
            pages.append([job["id"] for job in body["data"]])
            if not body["has_more"]:
                break
            after = body["last_id"]
        assert [len(p) for p in pages] == [2, 2, 1]
        assert [job_id for p in pages for job_id in p] == _newest_first(c, ids)  # each once, newest first


def test_order_asc_lists_the_oldest_first_and_the_default_page_is_twenty(tmp_path):
    with make_client(ScriptedBackend(), tmp_path) as c:
        ids = _made(c, 3)
        oldest_first = [job["id"] for job in c.get("/v1/videos", params={"order": "asc"}).json()["data"]]
        assert oldest_first == _newest_first(c, ids)[::-1]
        everything = c.get("/v1/videos").json()
        assert len(everything["data"]) == 3 and everything["has_more"] is False
        empty = c.get("/v1/videos", params={"limit": 0}).json()
        assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": True}


def test_an_empty_list_is_a_page_without_ids(tmp_path):
    with make_client(ScriptedBackend(), tmp_path) as c:
        assert c.get("/v1/videos").json() == {
            "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False,
        }  # fmt: skip


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"limit": 101}, "limit"),
        ({"limit": -1}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"order": "sideways"}, "order"),
        ({"after": "video_" + "0" * 32}, "after"),
        ({"after": "x" * 5000}, "after"),
    ],
)
def test_a_bad_query_is_a_400_naming_its_parameter(tmp_path, params, param):
    with make_client(ScriptedBackend(), tmp_path) as c:
        _made(c, 1)
        r = c.get("/v1/videos", params=params)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert len(error["message"]) < 400, error  # a long value is not echoed whole


def test_the_python_client_follows_the_pages_to_every_job(tmp_path):
    with make_client(ScriptedBackend(), tmp_path) as c:
        ids = _made(c, 3)
        client = TriptychClient("http://testserver", retries=0)
        client.http = c  # the app itself behind the client's HTTP calls
        assert [job["id"] for job in client.videos(page_size=1)] == _newest_first(c, ids)
        assert [job["id"] for job in client.videos(order="asc", page_size=2)] == _newest_first(c, ids)[::-1]


def test_a_deleted_job_leaves_the_list(tmp_path):
    with make_client(ScriptedBackend(), tmp_path) as c:
        kept, gone = _made(c, 2)
        assert c.delete(f"/v1/videos/{gone}").status_code == 200
        assert [job["id"] for job in c.get("/v1/videos").json()["data"]] == [kept]


def _job(job_id: str, status: str = "in_progress", step: int = 1) -> VideoJob:
    return VideoJob(id=job_id, model="tiny", status=status, step=step, total_steps=4, created_at=int(time.time()),
                    size="32x16", num_frames=5, fps=16, seed=7)  # fmt: skip


def test_a_listing_reads_again_only_the_jobs_whose_json_changed(tmp_path):
    store = ResultStore(tmp_path)
    for name in ("video_a", "video_b", "video_c"):
        store.save_job(_job(name), None)
    read: list[str] = []
    load_job = store.load_job
    store.load_job = lambda job_id: read.append(job_id) or load_job(job_id)  # type: ignore[method-assign]
    index = StoredJobIndex(store)

    assert sorted(s.job.id for s in index.jobs()) == ["video_a", "video_b", "video_c"] and sorted(read) == [
        "video_a", "video_b", "video_c",
    ]  # fmt: skip
    read.clear()
    assert len(index.jobs()) == 3 and read == []  # nothing changed: nothing read
    store.save_job(_job("video_b", "completed", 4), None)
    store.objects.delete(store.job_name("video_c"))
    jobs = {s.job.id: s.job for s in index.jobs()}
    assert read == ["video_b"] and jobs["video_b"].status == "completed" and set(jobs) == {"video_a", "video_b"}
