"""The Mooncake writes a worker's leader has under way: start one per TransferPush, report each
when it ends, and give back what its staged outputs held (pool bytes, or an in-place registration)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triptych.protocol import Failed, TransferPush, TransferPushed
from triptych_worker import slots
from triptych_worker.heads import HeadLinks
from triptych_worker.transfer import InPlaceTensors, PendingWrite, StagedTensors, TransferError, TransferStalled

if TYPE_CHECKING:
    from triptych_worker.runtime import Worker

log = logging.getLogger(__name__)


@dataclass
class Push:
    """A staged output on its way to a receiver: the Mooncake write under way out of it."""

    request_id: str
    staged: StagedTensors | InPlaceTensors
    write: PendingWrite


def start_push(worker: Worker, link: HeadLinks, msg: TransferPush) -> None:
    with worker._lock:
        staged = worker._staged.pop(msg.request_id, None)
    if staged is None:
        link.send(Failed(msg.request_id, worker.instance, "transfer_push for a request with nothing staged"))
        return
    if msg.slot_bytes and staged.nbytes > msg.slot_bytes:  # it would overwrite what lies past the slot
        error = f"transfer_push: {staged.nbytes} bytes staged do not fit the receiver's slot of {msg.slot_bytes}"
        _end_push(worker, link, msg.request_id, staged, Failed(msg.request_id, worker.instance, error))
        return
    try:
        if isinstance(staged, InPlaceTensors):
            write = staged.submit_write(msg.dest_session, msg.dest_addr)
        else:
            write = worker.transport.submit_write(
                msg.dest_session, staged.allocation.addr, msg.dest_addr, staged.nbytes
            )
    except Exception as exc:
        # A write of several ranges whose later range could not start while earlier ones are under way
        # raises TransferStalled (its outputs are kept: reported write_pending); one that started nothing
        # reads nothing, and its outputs are freed.
        _end_push(worker, link, msg.request_id, staged, _push_failed(worker, msg.request_id, exc))
        return
    worker._pushes.append(Push(msg.request_id, staged, write))


def check_pushes(worker: Worker, link: HeadLinks) -> None:
    """Report every push whose write has ended, and give its staged bytes back to the pool."""
    for push in list(worker._pushes):
        try:
            if not push.write.done():
                continue
        except Exception as exc:
            report: Failed | TransferPushed = _push_failed(worker, push.request_id, exc)
        else:
            report = TransferPushed(push.request_id, worker.instance, push.staged.nbytes, push.write.elapsed())
        worker._pushes.remove(push)
        _end_push(worker, link, push.request_id, push.staged, report)


def _push_failed(worker: Worker, request_id: str, exc: Exception) -> Failed:
    if not isinstance(exc, TransferError):  # a bug fails this request, never the worker
        log.error("request %s: push failed", request_id, exc_info=exc)
        return Failed(request_id, worker.instance, f"{type(exc).__name__}: {exc}")
    # A stalled write may still land: the head then keeps the receiver's slot out of use.
    return Failed(request_id, worker.instance, str(exc), write_pending=isinstance(exc, TransferStalled))


def _end_push(
    worker: Worker,
    link: HeadLinks,
    request_id: str,
    staged: StagedTensors | InPlaceTensors,
    report: Failed | TransferPushed,
) -> None:
    link.send(report)
    if isinstance(report, Failed) and report.write_pending and isinstance(staged, InPlaceTensors):
        # The engine may still read these tensors: never free memory under it (a stall is rare; this
        # holds its bytes until the worker exits).
        log.warning("request %s: keeping %d bytes of outputs the engine may still read", request_id, staged.nbytes)
        worker._unfinished_sends.append(staged)
    else:
        worker.free_staged(staged)
    slots.space_freed(worker, link)
