"""The wire protocol: typed control messages (msgpack) and tensors as raw frames.

No pickle anywhere: a peer can only ever make us build the message classes defined here.
"""

from triptych.protocol.codec import HeaderTooLarge, ProtocolError, UnknownMessageType, decode, encode
from triptych.protocol.messages import *  # noqa: F403
from triptych.protocol.tensors import TensorSpec, frames_to_tensors, tensors_to_frames

__all__ = [
    "HeaderTooLarge", "ProtocolError", "UnknownMessageType", "decode", "encode", "TensorSpec", "frames_to_tensors",
    "tensors_to_frames",
]  # fmt: skip
