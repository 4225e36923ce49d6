"""Rules of the reference design (docs/design.md) that nothing else states as a test, one each."""

from __future__ import annotations

import pytest

from tests.unit.core_harness import Harness
from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych.params import GenerationParams
from triptych.protocol import Submit, TransferReady, Work, encode
from triptych.roles import Role
from triptych_worker.parallel.ranks import master_port


def serve_args(*argv: str) -> ServeArgs:
    return ServeArgs.from_namespace(build_parser().parse_args(["serve", "--model-path", "m", *argv]))


def test_role_flags_win_over_the_generic_tp_size_and_sp_degree() -> None:
    worker = ("--disagg-server-addr", "tcp://h:1", "--num-gpus", "4")
    denoiser = serve_args("--disagg-role", "denoiser", *worker, "--sp-degree", "4", "--denoiser-sp", "2",
                          "--denoiser-tp", "2", "--tp-size", "4")  # fmt: skip
    assert (denoiser.parallelism().sp, denoiser.parallelism().tp) == (2, 2)
    generic = serve_args("--disagg-role", "denoiser", *worker, "--sp-degree", "4")
    assert generic.parallelism().sp == 4  # without a role flag the generic one applies


def test_encoder_urls_exclude_the_split_encoders() -> None:
    head = ("--disagg-role", "server", "--denoiser-urls", "tcp://127.0.0.4:1", "--decoder-urls", "tcp://127.0.0.5:1")
    with pytest.raises(ConfigError, match="either --encoder-urls or --prompt-encoder-urls"):
        serve_args(*head, "--encoder-urls", "tcp://127.0.0.6:1", "--prompt-encoder-urls", "tcp://127.0.0.7:1")
    serve_args(*head, "--prompt-encoder-urls", "tcp://127.0.0.7:1")  # either one alone is a topology


def test_the_master_port_defaults_to_the_work_port_plus_50() -> None:
    worker = ("--disagg-role", "denoiser", "--disagg-server-addr", "tcp://h:1", "--scheduler-port", "19001")
    assert master_port(serve_args(*worker)) == 19051
    assert master_port(serve_args(*worker, "--master-port", "29000")) == 29000


def test_an_uploaded_reference_image_never_travels_past_the_image_encoder() -> None:
    """Split encoders: the inlined reference goes to the image encoder only; the denoiser and decoder
    get the request without it (they never read it, and it may be megabytes)."""
    h = Harness({Role.PROMPT_ENCODER: 1, Role.IMAGE_ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    image = b"\x89PNG" + bytes(1000)
    h.core.on_frontend(b"c", encode(Submit("r", GenerationParams("edit it", 16, 16, image=image))))
    h.collect()
    sent: list[tuple[Role, object]] = []
    while h.pending or h.answers:
        if h.pending:
            url, msg = h.pending[0]
            sent.append((h.workers[url].role, msg))
            h.deliver()
        else:
            h.answer()
    carriers = [(role, msg) for role, msg in sent if isinstance(msg, Work | TransferReady)]
    assert [role for role, _ in carriers] == [Role.PROMPT_ENCODER, Role.IMAGE_ENCODER, Role.DENOISER, Role.DECODER]
    images = {role: msg.params.image for role, msg in carriers}  # type: ignore[attr-defined]
    assert images[Role.IMAGE_ENCODER] == image
    assert images[Role.PROMPT_ENCODER] is None and images[Role.DENOISER] is None and images[Role.DECODER] is None


def test_a_worker_that_loaded_another_model_gets_no_work_and_the_head_says_why() -> None:
    h = Harness({Role.ENCODER: 2, Role.DENOISER: 1, Role.DECODER: 1})
    h.core.model_fingerprint = "head-model"
    other, same = (w for w in h.workers.values() if w.role is Role.ENCODER)
    other.fingerprint, same.fingerprint = "another-model", "head-model"
    h.tick()
    for i in range(3):
        h.submit(f"r{i}")
    encoders = {url for url, msg in h.pending if isinstance(msg, Work)}
    assert encoders == {same.url}, "only the worker with the head's model gets work"
    assert [i["wrong_model"] for i in h.core.membership.snapshot()["encoder"]] == [True, False]


def test_the_fingerprint_tells_packages_apart_and_copies_alike(tiny_models, tmp_path) -> None:
    import shutil

    from triptych.families.package import package_fingerprint

    flux, wan = tiny_models["tiny-flux"], tiny_models["tiny-wan"]
    copy = shutil.copytree(flux, tmp_path / "elsewhere")
    assert package_fingerprint(flux) == package_fingerprint(copy) != package_fingerprint(wan)
    assert package_fingerprint(tmp_path / "no-package") == ""
