"""A video's length asked as OpenAI's SDK asks it (`videos.create(seconds="4")`): made into the frame
count nearest seconds x fps that the model takes, answered as both `num_frames` and `seconds`; a
length the model cannot make, or given twice, is a 400 naming `seconds`."""

from __future__ import annotations

import io
import zipfile

import pytest

from tests.api.test_http_api import ScriptedBackend, make_client, wait_for
from triptych.contract import ParamError
from triptych.families import ModelInfo
from triptych_head.api.video_length import frames_for

WAN = ModelInfo("tiny-wan", "WanPipeline", "video", 4, 5.0, size_multiple=16, frame_step=4, max_frames=81)
VIDEO = {"prompt": "waves", "size": "32x16", "num_inference_steps": 1}


def test_seconds_as_the_openai_sdk_sends_them_make_the_frames_the_job_has(tmp_path):
    backend = ScriptedBackend()
    with make_client(backend, tmp_path, model=WAN) as c:
        r = c.post("/v1/videos", json={**VIDEO, "seconds": "4"})  # the SDK's type: text
        assert r.status_code == 200, r.text
        assert (r.json()["num_frames"], r.json()["seconds"]) == (65, "4.0625")  # 1 + 4k nearest 4 s x 16 fps
        job = wait_for(c, r.json()["id"], "completed")
        assert backend.calls[0].num_frames == 65 and job["seconds"] == "4.0625"
        frames = zipfile.ZipFile(io.BytesIO(c.get(f"/v1/videos/{job['id']}/content?variant=frames").content))
        assert len(frames.namelist()) == 65
        assert [j["seconds"] for j in c.get("/v1/videos").json()["data"]] == ["4.0625"]


def test_seconds_follow_the_fps_asked_and_a_job_without_them_says_its_own(tmp_path):
    with make_client(ScriptedBackend(), tmp_path, model=WAN) as c:
        slow = c.post("/v1/videos", json={**VIDEO, "seconds": 2, "fps": 8}).json()
        plain = c.post("/v1/videos", json={**VIDEO, "num_frames": 33}).json()
    assert (slow["num_frames"], slow["fps"], slow["seconds"]) == (17, 8, "2.125")
    assert (plain["num_frames"], plain["seconds"]) == (33, "2.0625")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"seconds": 4, "num_frames": 33}, "seconds 4 and num_frames 33 were both given; give one"),
        ({"seconds": "6"}, "seconds 6 is longer than WanPipeline makes: at 16 fps that is 97 frames"),
        ({"seconds": 11, "fps": 8}, "it makes at most 81 (10.125 s)"),
        ({"seconds": "four"}, "seconds: Input should be a valid number"),
        ({"seconds": 0}, "seconds: Input should be greater than or equal to 0.001"),
    ],
)
def test_a_length_the_model_cannot_make_is_a_400_naming_seconds(extra, says, tmp_path):
    backend = ScriptedBackend()
    with make_client(backend, tmp_path, model=WAN) as c:
        r = c.post("/v1/videos", json={**VIDEO, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seconds", r.text
    assert says in r.json()["error"]["message"], r.json()
    assert backend.calls == []  # nothing reached the workers


@pytest.mark.parametrize(
    ("seconds", "fps", "step", "frames"),
    [(5, 16, 4, 81), (4, 16, 4, 65), (0.01, 16, 4, 1), (1, 24, 4, 25), (1.5, 10, 1, 15), (3, 30, 8, 89)],
)
def test_the_frames_are_the_nearest_the_model_takes(seconds, fps, step, frames):
    traits = ModelInfo("m", "WanPipeline", "video", 4, 5.0, frame_step=step)
    assert frames_for(seconds, fps, traits) == frames
    assert (frames - 1) % step == 0 and abs(frames - seconds * fps) <= step / 2 + 1


def test_a_length_past_the_model_s_longest_names_it():
    with pytest.raises(ParamError) as refused:
        frames_for(6, 16, WAN)
    assert refused.value.param == "seconds" and "at most 81 (5.0625 s)" in str(refused.value)
