"""The web playground in a real browser (Playwright driving Debian's Chromium, headless) against
real local deployments with the tiny models: an image whose bytes are the API's, an edit of an
uploaded reference (FLUX.1 Kontext) whose bytes are the API's edit, a video whose
progress bar advances with previews before the result, the pipeline view's instance counts and a
request moving through it, a phone-sized viewport, and an API key entered in the page.
Screenshots go to outputs/ (docs/playground.png is one of them)."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.harness import deployment
from tests.setup_check import missing
from tests.worker.test_role_pipelines import reference_png
from triptych_dev.localdeploy import LocalDeployment

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
OUTPUTS = Path(__file__).resolve().parents[2] / "outputs"
KEY = "playground-test-key"
DESKTOP = {"width": 1280, "height": 1000}
PHONE = {"width": 390, "height": 844}
REFERENCE = reference_png(40, 56)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    try:
        import playwright.sync_api as playwright
    except ImportError:
        missing("the playwright package", "`make setup` installs it with the test extra")
    if not Path(CHROMIUM).exists():
        missing(f"Debian's chromium ({CHROMIUM})", "`make setup` installs it")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def flux(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """Two denoisers, behind an API key."""
    tmp = tmp_path_factory.mktemp("flux")
    keys = tmp / "api-keys"
    keys.write_text(f"{KEY}\n")
    flags = ("--api-keys-file", str(keys))
    with deployment(tiny_models["tiny-flux"], tmp, denoisers=2, head_flags=flags) as dep:
        yield dep


@pytest.fixture(scope="module")
def wan(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with deployment(tiny_models["tiny-wan"], tmp_path_factory.mktemp("wan")) as dep:
        yield dep


@pytest.fixture(scope="module")
def kontext(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """FLUX.1 Kontext: text to image, and edits of a reference image."""
    with deployment(tiny_models["tiny-flux-kontext"], tmp_path_factory.mktemp("kontext")) as dep:
        yield dep


def new_page(browser, viewport: dict[str, int], bypass_csp: bool = True):
    """A page in its own context; bypass_csp lets the test evaluate its probes (the page's CSP forbids
    eval, which the playground itself never uses: the phone page below runs under it)."""
    return browser.new_context(viewport=viewport, bypass_csp=bypass_csp).new_page()


def screenshot(page, name: str) -> Image.Image:
    OUTPUTS.mkdir(exist_ok=True)
    path = OUTPUTS / name
    page.screenshot(path=str(path), full_page=True)
    image = Image.open(path).convert("RGB")
    pixels = np.asarray(image)
    assert pixels.std() > 10, f"{path} looks blank"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, f"{path} has almost no distinct colours"
    return image


def open_with_key(page, flux: LocalDeployment) -> None:
    """The playground of the FLUX deployment, its API key typed in, once it has read the model."""
    page.goto(flux.http + "/")
    page.fill("#apikey", KEY)
    page.dispatch_event("#apikey", "change")
    page.wait_for_function("document.querySelector('#model').textContent.includes('tiny-flux')")


def fill_request(page, prompt: str, width: int, height: int, steps: int, seed: int, preview_every: int) -> None:
    page.fill("#prompt", prompt)
    page.fill("#width", str(width))
    page.fill("#height", str(height))
    page.fill("#steps", str(steps))
    page.fill("#seed", str(seed))
    page.fill("#preview-every", str(preview_every))


def instance_counts(page) -> dict[str, int]:
    return page.eval_on_selector_all(
        ".role", "boxes => Object.fromEntries(boxes.map(b => [b.dataset.role, b.querySelectorAll('.instance').length]))"
    )


def test_the_page_and_its_files_need_no_key_but_the_api_does(flux: LocalDeployment):
    for path in ("/", "/static/app.js", "/static/style.css"):
        assert httpx.get(flux.http + path, timeout=30).status_code == 200, path
    assert httpx.get(flux.http + "/v1/pipeline", timeout=30).status_code == 401
    assert httpx.get(flux.http + "/static/../v1/pipeline", timeout=30).status_code in (401, 404)


def assert_timeline(page, roles: list[str]) -> None:
    """The result panel shows the request's timeline from its Server-Timing: each role's stage, its
    transfers, and the total, the parts adding up to at most the total."""
    page.wait_for_selector("#timeline:not([hidden]) .part[data-name=total]")
    parts = page.eval_on_selector_all(
        "#timeline .part", "rows => rows.map(r => [r.dataset.name, Number(r.dataset.ms)])"
    )
    names = [name for name, _ in parts]
    assert [n for n in names if n in roles] == roles, names
    assert any(n.startswith("transfer-") for n in names), names
    assert names[-1] == "total", names
    total = parts[-1][1]
    assert 0 < sum(ms for _, ms in parts[:-1]) <= total + 0.01 * len(parts), parts


def test_an_image_generated_in_the_page_is_the_api_s_image(browser, flux: LocalDeployment):
    page = new_page(browser, DESKTOP)
    open_with_key(page, flux)
    assert page.locator("#reference").is_hidden()  # a text-only model takes no reference image
    fill_request(page, "a lighthouse at dusk", 64, 48, 4, 11, 1)
    page.click("#generate")
    page.wait_for_selector("#result-image:not([hidden])", timeout=120_000)
    src = page.get_attribute("#result-image", "src")
    shown = base64.b64decode(src.removeprefix("data:image/png;base64,"))
    body = {"prompt": "a lighthouse at dusk", "size": "64x48", "num_inference_steps": 4, "seed": 11}
    r = httpx.post(
        f"{flux.http}/v1/images/generations", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert shown == base64.b64decode(r.json()["data"][0]["b64_json"])
    assert Image.open(io.BytesIO(shown)).size == (64, 48)
    assert page.eval_on_selector_all("#history li", "items => items.length") == 1
    assert_timeline(page, ["encoder", "denoiser", "decoder"])
    page.wait_for_function("document.querySelectorAll('.role .instance').length === 4")
    assert instance_counts(page) == {"encoder": 1, "denoiser": 2, "decoder": 1}
    assert page.eval_on_selector_all(".instance", "rows => rows.map(r => r.dataset.state)") == ["ready"] * 4
    urls = page.eval_on_selector_all(".instance .url", "spans => spans.map(s => s.textContent)")
    assert all(text.endswith(" · ready · 1 float32") for text in urls), urls  # its devices and dtype
    image = screenshot(page, "playground-image.png")
    assert image.width == DESKTOP["width"] and image.height >= 600

    page.close()

    # A phone, under the page's own Content-Security-Policy (so probes are selectors, not scripts).
    phone = new_page(browser, PHONE, bypass_csp=False)
    phone.goto(flux.http + "/")
    phone.fill("#apikey", KEY)
    phone.dispatch_event("#apikey", "change")
    phone.wait_for_selector(".role[data-role=decoder] .instance")
    assert phone.locator(".role .instance").count() == 4
    assert phone.locator("#model").inner_text().startswith("tiny-flux")
    box = phone.locator("#generate").bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    shot = screenshot(phone, "playground-phone.png")
    assert shot.width == PHONE["width"]  # nothing wider than the viewport (a full-page shot would widen)
    phone.close()


def test_an_image_request_that_got_no_answer_is_sent_again_under_its_key(browser, flux: LocalDeployment):
    """The page's first POST has its connection reset and the second gets a proxy's 503 (both made by
    Playwright in the browser's network: stand-ins for a head that died under the request and for an
    Ingress with no head behind it); the page sends it again with the same Idempotency-Key, and what
    the real head answers the third is the API's image."""
    page = new_page(browser, DESKTOP)
    keys: list[str | None] = []

    def head_dies_then_proxy_has_none(route) -> None:
        keys.append(route.request.headers.get("idempotency-key"))
        if len(keys) == 1:
            route.abort("connectionreset")
        elif len(keys) == 2:
            route.fulfill(status=503, content_type="application/json", body='{"error": {"message": "no endpoints"}}')
        else:
            route.continue_()

    page.route("**/v1/images/generations", head_dies_then_proxy_has_none)
    open_with_key(page, flux)
    fill_request(page, "a lighthouse after the storm", 64, 48, 4, 12, 1)
    page.click("#generate")
    page.wait_for_selector("#result-image:not([hidden])", timeout=120_000)
    shown = base64.b64decode(page.get_attribute("#result-image", "src").removeprefix("data:image/png;base64,"))
    page.close()
    assert len(keys) == 3 and keys[0] and len(set(keys)) == 1, keys
    body = {"prompt": "a lighthouse after the storm", "size": "64x48", "num_inference_steps": 4, "seed": 12}
    r = httpx.post(
        f"{flux.http}/v1/images/generations", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert shown == base64.b64decode(r.json()["data"][0]["b64_json"])


def test_an_error_the_page_shows_names_the_request_it_is_about(browser, flux: LocalDeployment):
    """A refusal the head answers with the request's id (X-Request-Id, made here by Playwright: a
    stand-in for a worker's refusal of a request the head had given an id) shows it, so a user can
    quote the id the head's logs and trace know the request by."""
    page = new_page(browser, DESKTOP)
    request_id = "img_" + "5f0c" * 8

    def refused(route) -> None:
        route.fulfill(
            status=400,
            content_type="application/json",
            headers={"X-Request-Id": request_id},
            body='{"error": {"message": "denoiser: loras: adapter ink has no tensors", "param": "loras"}}',
        )

    page.route("**/v1/images/generations", refused)
    open_with_key(page, flux)
    fill_request(page, "a lighthouse", 64, 48, 2, 1, 1)
    page.click("#generate")
    page.wait_for_selector("#error:not([hidden])", timeout=60_000)
    shown = page.text_content("#error")
    page.close()
    assert shown == f"400: denoiser: loras: adapter ink has no tensors (request {request_id})", shown


def test_an_edit_of_an_uploaded_reference_is_the_api_s_edit(browser, kontext: LocalDeployment):
    page = new_page(browser, DESKTOP)
    page.goto(kontext.http + "/")
    page.wait_for_selector("#reference:visible")  # /v1/models says the model takes a reference
    fill_request(page, "make it a watercolor", 64, 48, 3, 7, 1)
    page.set_input_files("#reference", files=[{"name": "ref.png", "mimeType": "image/png", "buffer": REFERENCE}])
    page.wait_for_selector("#reference-thumb:visible")
    with page.expect_request("**/v1/images/edits") as sent:
        page.click("#generate")
    assert sent.value.method == "POST"
    assert sent.value.headers["content-type"].startswith("multipart/form-data")
    page.wait_for_selector("#result-image:not([hidden])", timeout=120_000)
    shown = base64.b64decode(page.get_attribute("#result-image", "src").removeprefix("data:image/png;base64,"))
    fields = {"prompt": "make it a watercolor", "size": "64x48", "num_inference_steps": "3", "seed": "7"}
    r = httpx.post(f"{kontext.http}/v1/images/edits", data=fields,
                   files={"image": ("ref.png", REFERENCE, "image/png")}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    assert shown == base64.b64decode(r.json()["data"][0]["b64_json"])
    assert page.get_attribute("#progress", "max") == "3" and page.eval_on_selector("#progress", "p => p.value") == 3
    assert page.get_attribute("#preview", "data-step") == "3"  # a preview came with every step
    assert "edit of ref.png" in page.inner_text("#history li")
    screenshot(page, "playground-edit.png")
    page.close()


RECORD_PROGRESS = """() => {
  window.seen = {progress: [], previewBeforeResult: false, chips: [], roles: []};
  const note = () => {
    const role = document.querySelector('#role').textContent;
    if (window.seen.roles.at(-1) !== role) window.seen.roles.push(role);
    const p = document.querySelector('#progress');
    window.seen.progress.push(Number(p.value));
    const preview = !document.querySelector('#preview').hidden;
    const result = !document.querySelector('#result-video').hidden;
    if (preview && !result) window.seen.previewBeforeResult = true;
    for (const chip of document.querySelectorAll('.request.mine')) {
      window.seen.chips.push([chip.closest('.role').dataset.role, chip.dataset.done]);
    }
  };
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""


def test_a_video_shows_progress_and_previews_before_its_result_and_moves_through_the_pipeline(
    browser, wan: LocalDeployment
):
    page = new_page(browser, DESKTOP)
    page.goto(wan.http + "/")
    page.wait_for_function("document.body.dataset.kind === 'video'")
    # 256x256, 9 frames: ~3 s here, long enough for the pipeline view (polled every 700 ms) to show it
    # (64x64 takes ~0.3 s, which it may never see).
    fill_request(page, "waves on a beach", 256, 256, 10, 5, 2)
    page.fill("#frames", "9")
    page.evaluate(RECORD_PROGRESS)
    page.click("#generate")
    # The recorder notes every change of the page; a preview may show for less than a polling interval.
    page.wait_for_function("window.seen.previewBeforeResult", timeout=120_000)
    page.wait_for_selector(".request.mine")  # the pipeline view has caught up with it
    shot = screenshot(page, "playground-video-progress.png")
    assert shot.width == DESKTOP["width"] and shot.height >= 600
    shutil.copy(OUTPUTS / "playground-video-progress.png", OUTPUTS / "playground.png")  # docs/playground.png
    page.wait_for_selector("#result-video:not([hidden])", timeout=180_000)
    seen = page.evaluate("window.seen")
    steps = sorted(set(seen["progress"]))
    assert steps[-1] == 10 and len(steps) >= 3, steps  # the bar advanced step by step to the end
    assert seen["previewBeforeResult"]
    # Where the request is, as its own event stream tells the page: through the three roles, in order.
    order = ["encoder", "denoiser", "decoder"]
    path = [role for role in seen["roles"] if role in order]
    assert path == order, seen  # a stream opened after the POST starts with what it missed
    # The polled pipeline view (every 700 ms; a stage can be shorter) showed it where it was, with the
    # roles it had passed through, never going back.
    assert seen["chips"], seen
    for role, done in seen["chips"]:
        assert done == " ".join(order[: order.index(role)]), seen["chips"]
    chip_roles = [order.index(role) for role, _ in seen["chips"]]
    assert chip_roles == sorted(chip_roles), seen["chips"]
    assert page.evaluate("document.querySelector('#result-video').duration") > 0
    assert_timeline(page, order)
    assert instance_counts(page) == {"encoder": 1, "denoiser": 1, "decoder": 1}
    screenshot(page, "playground-video.png")
    page.close()


def test_an_image_made_without_a_seed_is_remembered_with_the_seed_the_head_drew(browser, flux: LocalDeployment):
    """The form's seed left empty, the head draws one and its answer says which: the history shows it,
    and choosing the entry puts it back in the form, so the same image can be made again."""
    page = new_page(browser, DESKTOP)
    open_with_key(page, flux)
    page.evaluate("localStorage.removeItem('triptych.history')")
    fill_request(page, "a lighthouse at noon", 32, 32, 2, 0, 0)
    page.fill("#seed", "")
    page.click("#generate")
    page.wait_for_selector("#result-image:not([hidden])", timeout=120_000)
    seed = page.evaluate("JSON.parse(localStorage.getItem('triptych.history'))[0].seed")
    assert isinstance(seed, int), seed
    assert f"seed {seed} ·" in page.inner_text("#history li")
    page.fill("#seed", "")
    page.click("#history li")
    assert page.input_value("#seed") == str(seed)
    page.close()


def test_history_survives_a_reload_and_can_be_cleared(browser, wan: LocalDeployment):
    page = new_page(browser, DESKTOP)
    page.goto(wan.http + "/")
    page.evaluate(
        "localStorage.setItem('triptych.history', JSON.stringify([{prompt: 'x', size: '64x64', seed: 1, seconds: 1}]))"
    )
    page.reload()
    assert page.eval_on_selector_all("#history li", "items => items.length") == 1
    page.click("#clear-history")
    assert page.eval_on_selector_all("#history li", "items => items.length") == 0
    page.close()


def test_a_video_whose_stream_ends_early_is_followed_again_and_its_last_bytes_are_given_back(
    browser, wan: LocalDeployment
):
    """The first events stream of each job ends after one event without a result (made by Playwright:
    what a head's stream does when the job moves to another head, a drain or a take-over); the page
    follows the job again and shows its video. The content answers without Server-Timing (as an object
    store's, after --results-presign redirects there): the timeline comes from the job. A second video
    gives back the first one's bytes (its blob: URL no longer loads)."""
    page = new_page(browser, DESKTOP)
    followed: list[str] = []

    def first_stream_ends_early(route) -> None:
        followed.append(route.request.url)
        if followed.count(route.request.url) == 1:
            route.fulfill(
                status=200, content_type="text/event-stream", body='event: state\ndata: {"state": "queued"}\n\n'
            )
        else:
            route.continue_()

    def content_from_the_bucket(route) -> None:
        answer = route.fetch()
        headers = {k: v for k, v in answer.headers.items() if k.lower() != "server-timing"}
        route.fulfill(response=answer, headers=headers)

    page.route("**/v1/videos/*/events", first_stream_ends_early)
    page.route("**/v1/videos/*/content", content_from_the_bucket)
    page.goto(wan.http + "/")
    page.wait_for_function("document.body.dataset.kind === 'video'")
    fill_request(page, "waves at night", 64, 64, 3, 7, 0)
    page.fill("#frames", "5")
    page.click("#generate")
    page.wait_for_selector("#result-video:not([hidden])", timeout=120_000)
    assert page.text_content("#role") == "done"
    assert_timeline(page, ["encoder", "denoiser", "decoder"])
    first = page.get_attribute("#result-video", "src")
    assert first and first.startswith("blob:"), first
    assert page.evaluate("url => fetch(url).then(r => r.ok)", first)

    page.fill("#seed", "8")
    page.click("#generate")
    video = "document.querySelector('#result-video').src"
    page.wait_for_function(f"{video}.startsWith('blob:') && {video} !== {first!r}", timeout=120_000)
    gone = page.evaluate("url => fetch(url).then(() => false, () => true)", first)
    page.close()
    assert len(followed) == 4 and len(set(followed)) == 2, followed  # each job's stream, twice
    assert gone, "the first video's blob: URL still loads"
