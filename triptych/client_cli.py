"""`triptych generate / edit / video / videos / status`: the HTTP client on the command line.

    triptych generate "a lighthouse at dusk" -o out.png --size 512x512 --seed 1 --steps 20
    triptych edit photo.png "make it a watercolor" -o edited.png --seed 1   # or an http(s) URL
    triptych video "waves on a beach" -o out.mp4 --frames 33
    triptych videos                                                           # the video jobs, newest first
    triptych status

They talk to a head's HTTP API only: `--url` (or TRIPTYCH_URL, default http://127.0.0.1:30000) and
`--api-key` (or TRIPTYCH_API_KEY) when the head has --api-keys-file. Progress (the role a request
is at, denoising steps, time left) comes from the request's Server-Sent Events; on a terminal it
is a live bar, elsewhere one line per event. Ctrl-C during `video` cancels the job on the server.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triptych.contract import CONTRACT, EDITS, IMAGES, PNG, VIDEOS, Contract

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from rich.console import Console

    from triptych.client import Event, TriptychClient

CLIENT_COMMANDS = ("generate", "edit", "video", "videos", "status")
DEFAULT_URL = "http://127.0.0.1:30000"
INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


COMMAND_ENDPOINTS = {"generate": IMAGES, "edit": EDITS, "video": VIDEOS}
# what the command itself does with a value
CLI_NOTES = {
    "n": "out.png becomes out-0.png, out-1.png, ...",
    "output_format": "unless given, -o's suffix says it (.png, .jpg or .jpeg, .webp); the two must agree",
}
# -o's suffix: the output_format asked for (none: as --output-format says, else PNG)
SUFFIX_FORMATS = {".png": PNG, ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
VIDEO_SUFFIX = ".mp4"  # a video job's content


def add_request_options(parser: argparse.ArgumentParser, endpoint: str, contract: Contract = CONTRACT) -> None:
    """One option per parameter of `contract` that `endpoint` takes and that has a CLI flag. Omitted
    options are not sent: the server's defaults apply."""
    names = []
    for param in contract.taken_by(endpoint):
        if param.cli is None:
            continue
        default = param.default_for(endpoint)
        notes = [param.doc, *(["default: " + str(default)] if default is not None else []), CLI_NOTES.get(param.name)]
        kind: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction} if param.type is bool else {"type": param.type}
        )
        if param.type is float:  # JSON has no NaN or infinity: refused here, not by the encoder mid-request
            kind = {"type": _finite}
        if param.type is list:  # the LoRA adapters: one option per adapter, NAME or NAME=WEIGHT
            kind = {"action": "append", "type": _lora_choice, "metavar": "NAME[=WEIGHT]"}
        parser.add_argument(param.cli, dest=param.name, help="; ".join(n for n in notes if n), **kind)
        names.append(param.name)
    parser.set_defaults(request_params=tuple(names))


def _lora_choice(text: str) -> dict[str, object]:
    from triptych.lora import choice_option

    try:
        return choice_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


MAX_RETRIES = 100  # --retries: with the backoff's 4 s, several minutes of a head that does not come back
MAX_SHOWN = 100_000  # videos --limit: more than any store keeps


def _whole_number(maximum: int) -> Callable[[str], int]:
    """An argparse type: a whole number from 0 to `maximum`, refused in words otherwise."""

    def parse(text: str) -> int:
        if not text.isdigit() or int(text) > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to {maximum}")
        return int(text)

    return parse


def add_client_commands(sub: Any, contract: Contract = CONTRACT) -> None:
    """The client subcommands, on `triptych`'s subparsers; their request options come from `contract`."""
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument(
        "--url",
        default=os.environ.get("TRIPTYCH_URL", DEFAULT_URL),
        help="the head's HTTP URL (a Service or Ingress), or several heads' URLs, comma-separated, tried in turn",
    )
    connection.add_argument("--api-key", default=os.environ.get("TRIPTYCH_API_KEY"), help="Bearer key, if required")
    connection.add_argument(
        "--retries",
        type=_whole_number(MAX_RETRIES),
        default=3,
        metavar="N",
        help="send a request again up to N times when its head went away or asked to wait (default 3; 0: never)",
    )
    reference = argparse.ArgumentParser(add_help=False)
    reference.add_argument("image", help="the reference image: a file, or an http(s) URL the server fetches")
    request = argparse.ArgumentParser(add_help=False)
    request.add_argument("prompt")
    request.add_argument("-o", "--output", required=True, type=Path, help="file to write")

    generate = sub.add_parser("generate", parents=[request, connection], help="text to image through a head's HTTP API")
    edit = sub.add_parser(
        "edit", parents=[reference, request, connection], help="a reference image and a prompt to an image"
    )
    video = sub.add_parser("video", parents=[request, connection], help="text to video, with a live progress bar")
    for command, parser in (("generate", generate), ("edit", edit), ("video", video)):
        add_request_options(parser, COMMAND_ENDPOINTS[command], contract)
    sub.add_parser("status", parents=[connection], help="the head's pools: instances, free slots, queues")
    videos = sub.add_parser("videos", parents=[connection], help="the video jobs this key sees, every head's")
    shown = _whole_number(MAX_SHOWN)
    videos.add_argument("--limit", type=shown, default=20, metavar="N", help="show N jobs (default 20; 0: all)")
    videos.add_argument("--oldest-first", action="store_true", help="the oldest first (default: the newest)")


def run_client_command(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from triptych.client import ClientError, Reference, TriptychClient

    console = Console(stderr=True)
    try:
        if ns.command in COMMAND_ENDPOINTS:
            _check_output(ns.output)  # before the server does the work that would be lost
            _check_suffix(ns)
        client = TriptychClient(ns.url, ns.api_key, retries=ns.retries)
    except ClientError as exc:
        return print_error(console, str(exc))
    try:
        if ns.command == "generate":
            return _images(client.stream_images(image_request_body(ns)), ns, console)
        if ns.command == "edit":
            return _images(client.stream_edits(image_request_body(ns), Reference.of(ns.image)), ns, console)
        if ns.command == "video":
            return _video(client, ns, console)
        out = Console()
        # Off a terminal (CI logs, pipes) rich would fit a table into 80 columns and cut every
        # address to "tcp://127.0…": a log is read whole, so give the table the room it needs.
        out = out if out.is_terminal else Console(width=STATUS_WIDTH_OFF_TERMINAL)
        if ns.command == "videos":
            return _videos(client, ns, out)
        return _status(client, out)
    except ClientError as exc:
        return print_error(console, str(exc))
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (a video job is cancelled in _video)
        console.print("interrupted", highlight=False)
        return INTERRUPTED
    finally:
        client.close()


STATUS_WIDTH_OFF_TERMINAL = 1000


def failure(final: Event) -> str:
    """A stream's error event in words, naming the request (the id the head's logs use), as an HTTP
    error's are (triptych.client)."""
    from triptych.client import naming

    return naming(final.data["error"]["message"], final.data.get("id"))


def print_error(console: Console, message: str) -> int:
    """One line on stderr, however long (soft_wrap: rich would wrap it at the console's width); returns 1."""
    console.print(f"triptych: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return 1


def request_body(ns: argparse.Namespace) -> dict[str, Any]:
    """The request's JSON body: the prompt and the request options given (add_request_options)."""
    given = {name: getattr(ns, name) for name in ns.request_params}
    return {"prompt": ns.prompt, **{k: v for k, v in given.items() if v is not None}}


def image_request_body(ns: argparse.Namespace) -> dict[str, Any]:
    """request_body, asking for the format -o's suffix names when --output-format is not given."""
    body = request_body(ns)
    if "output_format" not in body and (named := SUFFIX_FORMATS.get(ns.output.suffix.lower())) is not None:
        body["output_format"] = named
    return body


def _check_output(output: Path) -> None:
    """`-o` names a file this command can write: its folder exists, and it is not a folder itself."""
    from triptych.client import ClientError

    if output.is_dir():
        raise ClientError(f"-o {output}: is a folder; give the file to write")
    folder = output.parent
    if not folder.is_dir():
        raise ClientError(f"-o {output}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ClientError(f"-o {output}: cannot write in {folder}")


def _check_suffix(ns: argparse.Namespace) -> None:
    """`-o`'s suffix names what the answer is (a file named .png holding a JPEG misleads whatever opens
    it): an image's format, agreeing with --output-format; a video's .mp4. No suffix is taken as is."""
    from triptych.client import ClientError

    suffix = ns.output.suffix.lower()
    if not suffix:
        return
    if ns.command == "video":
        if suffix != VIDEO_SUFFIX:
            raise ClientError(f"-o {ns.output}: a video comes as MP4; give a {VIDEO_SUFFIX} file")
        return
    named = SUFFIX_FORMATS.get(suffix)
    if named is None:
        raise ClientError(
            f"-o {ns.output}: {suffix} is not a format the head writes; give a {', '.join(SUFFIX_FORMATS)} file "
            "(or --output-format and a name without a suffix)"
        )
    asked = getattr(ns, "output_format", None)
    if asked is not None and asked != named:
        raise ClientError(
            f"-o {ns.output} names {named}, but --output-format asks for {asked}: give -o a "
            f"{next(s for s, f in SUFFIX_FORMATS.items() if f == asked)} suffix, or leave --output-format out"
        )


def output_paths(output: Path, n: int) -> list[Path]:
    return [output] if n == 1 else [output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(n)]


def _images(events: Iterator[Event], ns: argparse.Namespace, console: Console) -> int:
    """Follow a streamed image request (generation or edit) and write its images."""
    import base64

    with ProgressView(console, "image") as view:
        final = view.follow(events)
    if final.event != "completed":
        return print_error(console, failure(final))
    seed = final.data.get("seed")  # the one the head drew when no --seed was given: --seed N makes it again
    for path, item in zip(output_paths(ns.output, ns.n or 1), final.data["data"], strict=True):
        path.write_bytes(base64.b64decode(item["b64_json"]))
        said = f"wrote {path}" + (f" (seed {seed})" if seed is not None else "")
        console.print(said, highlight=False, soft_wrap=True)  # one line, however long the path
    return 0


def _video(client: TriptychClient, ns: argparse.Namespace, console: Console) -> int:
    try:
        job = client.create_video(request_body(ns))
    except KeyboardInterrupt:
        console.print(
            "interrupted before the head answered: if it made the job, `triptych videos` lists it and "
            "DELETE /v1/videos/ID cancels it",
            highlight=False,
        )
        return INTERRUPTED
    console.print(f"{job['id']} {job['status']}", highlight=False)
    try:
        with ProgressView(console, job["id"]) as view:
            final = view.follow(client.video_events(job["id"]))
    except KeyboardInterrupt:
        ended = client.cancel_video(job["id"])
        console.print(f"cancelled {job['id']} on the server ({ended['status']})", highlight=False)
        return INTERRUPTED
    if final.event != "completed":
        return print_error(console, failure(final))
    size = client.save_video(job["id"], ns.output)
    seed = f", seed {job['seed']}" if job.get("seed") is not None else ""  # --seed makes the same video again
    console.print(f"wrote {ns.output} ({size} bytes{seed})", highlight=False, soft_wrap=True)
    return 0


class ProgressView:
    """Shows a request's progress events: a live bar on a terminal, one line per event elsewhere."""

    def __init__(self, console: Console, label: str) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("{task.fields[role]:<8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not self.live,
        )
        self.task = self.progress.add_task(label, total=None, role="queued")

    def __enter__(self) -> ProgressView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def follow(self, events: Any) -> Event:
        """Show every event until the last one (completed or error), and return that."""
        from triptych.client import ClientError

        last = None
        for event in events:
            last = event
            self.show(event)
            if event.event in ("completed", "error"):
                return event
        if last is None:
            raise ClientError("the head closed the progress stream without an event")
        raise ClientError(f"the progress stream ended without a result (last event: {last.event})")

    def show(self, event: Event) -> None:
        data = event.data
        role = data.get("role") or data.get("state", "").lower()
        if event.event == "step":
            self.progress.update(self.task, total=data["total_steps"], completed=data["step"], role=role)
            line = f"{role} step {data['step']}/{data['total_steps']}"
        elif event.event == "state":
            self.progress.update(self.task, role=role)
            line = f"{role} {data['state']}"
        elif event.event == "dropped":
            line = f"(missed {data['dropped']} events)"
        else:
            line = event.event
        if not self.live:
            self.console.print(line, highlight=False, markup=False)


def _status(client: TriptychClient, console: Console) -> int:
    from rich.table import Table

    view = client.pipeline()
    # A full-pipeline pool: its denoisers run every stage (--disagg-full-pipeline) and return pixels.
    topology = "  full pipeline" if view.get("topology") == "full_pipeline" else ""
    draining = "  (draining)" if view.get("draining") else ""
    table = Table(title=f"{client.url}  model {view['model']}{topology}{draining}")
    for column in ("role", "instance", "state", "devices", "free slots", "queued", "running", "dispatched"):
        table.add_column(
            column,
            justify="right" if column in ("queued", "running", "dispatched") else "left",
            no_wrap=column == "instance",  # an address is copied whole, never cut or folded
        )
    for role, info in view["roles"].items():
        instances = info["instances"] or [None]
        for i, inst in enumerate(instances):
            first = i == 0
            cells = [role if first else "", "-", "none", "-", "-"] if inst is None else [
                role if first else "", inst["url"], instance_state(inst), instance_devices(inst),
                f"{inst['free_slots']}/{inst['capacity']}",
            ]  # fmt: skip
            counts = [str(info["queued"]), str(info["running"])] if first else ["", ""]
            table.add_row(*cells, *counts, "-" if inst is None else str(inst["dispatched"]))
    console.print(table)
    console.print(f"{len(view['requests'])} requests in flight", highlight=False)
    return 0


def _videos(client: TriptychClient, ns: argparse.Namespace, console: Console) -> int:
    import itertools

    from rich.table import Table

    jobs = client.videos("asc" if ns.oldest_first else "desc", page_size=min(ns.limit or 100, 100))
    shown = list(itertools.islice(jobs, ns.limit or None))
    table = Table(title=f"{client.url}  video jobs")
    for column in ("id", "status", "progress", "size", "frames", "created (UTC)", "expires (UTC)"):
        right = column in ("progress", "frames")
        table.add_column(column, no_wrap=column == "id", justify="right" if right else "left")
    for job in shown:
        table.add_row(
            job["id"], job["status"], f"{job['progress']}%", job["size"], str(job["num_frames"]),
            _utc(job["created_at"]), _utc(job.get("expires_at")),
        )  # fmt: skip
    console.print(table)
    console.print(f"{len(shown)} jobs shown", highlight=False)
    return 0


def _utc(seconds: int | None) -> str:
    return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def instance_devices(inst: dict[str, Any]) -> str:
    """How many devices it runs on and in what dtype ("2 bfloat16"; a simulated worker: its count alone)."""
    return f"{inst.get('devices', 1)} {inst.get('dtype', '')}".strip()


def instance_state(inst: dict[str, Any]) -> str:
    if not inst["alive"]:
        return "down"
    if inst["draining"] or inst["leaving"]:
        return "draining"
    if inst.get("wrong_topology"):
        return "wrong topology"
    return "ready" if inst["ready"] else "alive"
