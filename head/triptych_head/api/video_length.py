"""A video's length asked in seconds, as OpenAI's `videos.create(seconds="4")` asks it.

The workers make frames; a client may ask for `num_frames`, or for `seconds`, which the head makes
into the frame count nearest seconds x fps that the served model takes (a WAN-like model takes
1 + a multiple of 4 frames: 4 s at 16 fps is 65 frames, 4.06 s). The job answers both: its
`num_frames`, and its `seconds` as they are (VideoJob.seconds). Asking for both is refused, so a
client is never served a length other than the one it gave.
"""

from __future__ import annotations

from typing import Any

from triptych.contract import CONTRACT, MAX_FRAMES, ModelTraits, ParamError

SECONDS = "seconds"
FRAMES = "num_frames"


def with_frames(values: dict[str, Any], given: set[str], traits: ModelTraits) -> dict[str, Any]:
    """`values` (a video request's, its body dumped) with `seconds` made into num_frames, if given.
    `given`: the fields the client sent. ParamError naming `seconds` when the model cannot make it, or
    when num_frames was sent too."""
    seconds = values.get(SECONDS)
    if seconds is None or traits.kind != "video":  # an image model is refused for the endpoint itself
        return values
    fps = values["fps"]
    if FRAMES in given:
        frames = values[FRAMES]
        raise ParamError(
            SECONDS,
            f"seconds {seconds:g} and num_frames {frames} were both given; give one (num_frames {frames} lasts "
            f"{frames / fps:g} s at {fps} fps)",
        )
    return {**values, FRAMES: frames_for(seconds, fps, traits)}


def frames_for(seconds: float, fps: int, traits: ModelTraits) -> int:
    """The frame count of a video of `seconds` at `fps`: the one nearest seconds x fps that `traits`
    takes (1 + k x frame_step). ParamError naming `seconds` when the model makes no video that long."""
    step = max(traits.frame_step, 1)
    frames = 1 + step * max(round((seconds * fps - 1) / step), 0)
    longest = int(CONTRACT[FRAMES].limits_for(traits).maximum or MAX_FRAMES)
    if frames > longest:
        raise ParamError(
            SECONDS,
            f"seconds {seconds:g} is longer than {traits.pipeline_class} makes: at {fps} fps that is {frames} "
            f"frames, and it makes at most {longest} ({longest / fps:g} s); give fewer seconds, or a lower fps",
        )
    return frames
