"""POST /v1/images/generations (text-to-image) and POST /v1/images/edits (a reference image and a prompt).

Both are synchronous and answer alike.

The client waits on the connection for its pixels, so a client that goes away no longer wants
them: the request is cancelled (its stages stop at their next step, its worker slots free).
With `stream: true` the answer is Server-Sent Events (image_stream.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from triptych.contract import EDITS, IMAGES, PNG
from triptych.params import GenerationParams
from triptych_head.api import image_body
from triptych_head.api.context import REQUEST_ID_HEADER, HeadContext, errors_named, new_request_id
from triptych_head.api.deadlines import ESTIMATE_HEADER, estimate_seconds, with_estimate
from triptych_head.api.direct import DirectRoute
from triptych_head.api.errors import APIError
from triptych_head.api.idempotent import answer_once, fingerprint, idempotency_key
from triptych_head.api.image_stream import Completed, ImageStream
from triptych_head.api.key_limits import key_limit
from triptych_head.api.ownership import owner_of
from triptych_head.api.reference import Reference, edit_form_schema, read_edit_form
from triptych_head.api.schemas import ImageData, ImageGenerationResponse, RequestBody, RequestModels
from triptych_head.api.store_calls import from_store
from triptych_head.backend import GenerationOutput
from triptych_head.deadline import Estimate
from triptych_head.idempotency import Body
from triptych_head.media import ImageFormat
from triptych_head.timeline import SERVER_TIMING

log = logging.getLogger(__name__)


def image_routes(models: RequestModels) -> APIRouter:
    """The two image endpoints, taking the request models of the head's contract. A JSON body of
    POST /v1/images/generations is served by `direct_routes`, in front of FastAPI's router."""
    router = APIRouter(tags=["images"])

    async def declared_create_images(body: RequestBody, request: Request) -> Response:
        return await create_images(body, request)

    async def edit_images(request: Request) -> Response:
        """Multipart: `image` (a file, or an http(s) URL as text), `prompt`, and optionally the other
        fields of the form's schema (`size` defaults to the reference's size)."""
        ctx: HeadContext = request.app.state.ctx
        ctx.let_in()
        if not ctx.model.edits:
            raise APIError(
                400,
                f"model {ctx.model.id!r} takes no reference image here (a text-to-image model, or no pool of "
                "this deployment encodes references: --encoder-urls or --image-encoder-urls); "
                "use POST /v1/images/generations",
                "image",
            )
        body, reference = await read_edit_form(request, models.edits, ctx.max_request_bytes)
        values = body.model_dump()
        return await _images(ctx, EDITS, values, ctx.params_for(EDITS, values, reference), request, reference)

    declared_create_images.__annotations__["body"] = models.images  # FastAPI reads the body's model from here
    router.post(IMAGES, response_model=ImageGenerationResponse, name="create_images")(declared_create_images)
    router.post(EDITS, response_model=ImageGenerationResponse, openapi_extra=edit_form_schema(models.edits))(
        edit_images
    )
    return router


def direct_routes(models: RequestModels) -> dict[tuple[str, str], DirectRoute]:
    return {("POST", IMAGES): DirectRoute(models.images, create_images)}


async def create_images(body: RequestBody, request: Request) -> Response:
    ctx: HeadContext = request.app.state.ctx
    ctx.let_in()
    values = body.model_dump()
    return await _images(ctx, IMAGES, values, ctx.params_for(IMAGES, values), request)


async def _images(
    ctx: HeadContext,
    endpoint: str,
    values: dict[str, Any],
    params: GenerationParams,
    request: Request,
    reference: Reference | None = None,
) -> Response:
    """The answer carries the request's id (X-Request-Id, also on an error once the id was given), the
    run's Server-Timing header (timeline.py) and the admission's estimate (deadlines.py); a replayed
    one carries none of them, except a streamed replay's id (the run it replays: progress_response).
    `values`: the body's, dumped."""
    if values["preview_every"] and not values["stream"]:
        raise APIError(400, "preview_every needs stream: true (previews arrive as Server-Sent Events)", "preview_every")
    form = image_format(values)
    key = idempotency_key(request)
    deadline = ctx.deadline(request, values)
    level = ctx.priority(request, values)
    if values["stream"]:

        async def respond(output: GenerationOutput, request_id: str) -> Completed:
            """The `completed` event's data: the plain answer's, with the request's id first and its
            Server-Timing last (the headers went first); a large b64_json one in pieces, as a plain one."""
            first, last = {"id": request_id}, {"server_timing": output.server_timing}
            if image_body.streams(values, output.pixels):
                images = image_body.images_of(output.pixels)
                return image_body.b64_body(images, int(time.time()), params.seed, ctx.media, form, first, last)
            answer = await _response(ctx, values, form, output, params.seed, request_id, request)
            return {**first, **answer.model_dump(), **last}

        stream = ImageStream(ctx, params, request, level, values["preview_every"], respond)
        if key is not None:
            return await stream.under_key(key, fingerprint(endpoint, values, reference), deadline)
        return stream.admitted(deadline)

    admitted: list[Estimate | None] = []  # the run's estimate (none when the key's answer is replayed)

    timing: dict[str, str] = {}  # the run's headers: its id, and where its time went

    async def run() -> tuple[GenerationOutput, str]:
        request_id = new_request_id("img")
        timing[REQUEST_ID_HEADER] = request_id
        with errors_named(request_id):
            admitted.append(ctx.admit(request_id, params, deadline, key=key_limit(request), owner=owner_of(request)))
            output = await _generate_while_connected(ctx, params, request_id, request, level)
        if output.server_timing:
            timing[SERVER_TIMING] = output.server_timing
        return output, request_id

    if key is None:  # the common path: answered as a Response, large base64 bodies streamed (image_body.py)
        output, request_id = await run()
        seconds = estimate_seconds(admitted[0])
        headers = {**timing, ESTIMATE_HEADER: f"{seconds:.3f}"} if seconds is not None else timing
        if image_body.streams(values, output.pixels):
            return image_body.streamed(output.pixels, params.seed, ctx.media, form, headers)
        return image_body.whole(await _response(ctx, values, form, output, params.seed, request_id, request), headers)

    async def answered() -> Body:
        output, request_id = await run()
        if image_body.streams(values, output.pixels):  # stored and sent as it is encoded, never whole
            images = image_body.images_of(output.pixels)
            return image_body.b64_body(images, int(time.time()), params.seed, ctx.media, form)
        return (await _response(ctx, values, form, output, params.seed, request_id, request)).model_dump_json().encode()

    answer = await answer_once(ctx, request, key, fingerprint(endpoint, values, reference), answered)
    answer.headers.update(timing)
    return with_estimate(answer, estimate_seconds(admitted[0]) if admitted else None)


def image_format(values: dict[str, Any]) -> ImageFormat:
    """The request's output_format and output_compression; a compression for a PNG is a 400 (PNG is
    lossless: it would change nothing, and the client likely meant another format)."""
    name, quality = values["output_format"], values["output_compression"]
    if name == PNG and quality is not None:
        message = "output_compression applies to jpeg and webp; png is lossless: leave it out, or set output_format"
        raise APIError(400, message, "output_compression")
    return ImageFormat(name, quality)


async def _response(
    ctx: HeadContext,
    values: dict[str, Any],
    form: ImageFormat,
    output: GenerationOutput,
    seed: int,
    request_id: str,
    request: Request,
) -> ImageGenerationResponse:
    """The answer: the images inline (b64_json) or written to the result store (url), which every head
    serves."""
    files = await image_body.encode_images(output.pixels, ctx.media, form)
    if values["response_format"] == "b64_json":
        data = image_body.b64_data(files)
    else:
        data = []
        for i, file in enumerate(files):
            # its random part: the id shows (ownership.py)
            name = f"{request_id}-{i}-{secrets.token_hex(16)}{form.suffix}"
            stored = ctx.results.image_name(name)
            await from_store(f"storing {stored}", ctx.results.objects.put_bytes, stored, file, form.media_type)
            data.append(ImageData(url=await _image_url(ctx, name, form, request)))
    return ImageGenerationResponse(created=int(time.time()), data=data, seed=seed)


async def _image_url(ctx: HeadContext, name: str, form: ImageFormat, request: Request) -> str:
    """Where the client fetches the image: the store itself (--results-presign), or any head."""
    results = ctx.results
    if results.presign_s:
        stored = results.image_name(name)
        url = await from_store(
            f"for {stored}", results.objects.presigned_url, stored, results.presign_s, form.media_type, None
        )
        if url is not None:
            return url
    return str(request.url_for("get_file", kind="images", name=name))


async def _generate_while_connected(
    ctx: HeadContext, params: GenerationParams, request_id: str, request: Request, level: int
) -> GenerationOutput:
    """ctx.generate, cancelled (Cancel to the DiffusionServer) as soon as the client disconnects.
    The watcher cancels the generation from a done-callback, and the generation is awaited as it
    is: no asyncio.wait per request (measurable at hundreds of requests per second)."""
    generation = asyncio.ensure_future(ctx.generate(params, request_id, priority=level))
    gone = asyncio.ensure_future(_client_gone(request))
    gone.add_done_callback(lambda _: generation.cancel())
    try:
        return await generation  # this handler cancelled: so is the generation (the backend sends Cancel)
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled():  # the backend has sent Cancel: stages stop, slots free
            message = "the client disconnected; the request was cancelled"
            raise APIError(499, message, code="client_disconnected") from None
        raise
    finally:
        gone.cancel()
        if not generation.done():  # this handler itself was cancelled
            generation.cancel()
        ctx.release(request_id)  # admitted by the caller; released here even if generation never started


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected. The body was read already, so the next message the
    server delivers is the disconnect (it waits for it; nothing else arrives on this request)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
