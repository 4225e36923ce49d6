"""triptych_dev.launch_pool's arguments (the deployment: tests/e2e/test_split_encoders.py, test_image_edits.py)."""

from __future__ import annotations

import pytest

import triptych_dev
from triptych.roles import Role
from triptych_dev.localdeploy import device_flags
from triptych_dev.pool import role_devices, serve_flags_argv


def test_launch_pool_is_the_public_entry() -> None:
    from triptych_dev.pool import launch_pool

    assert triptych_dev.launch_pool is launch_pool


def test_the_core_s_old_name_says_where_launch_pool_went() -> None:
    import triptych

    with pytest.raises(AttributeError, match="from triptych_dev import launch_pool"):
        triptych.launch_pool  # noqa: B018


def test_role_device_arguments_are_named_after_the_roles() -> None:
    kwargs = {"prompt_encoder_devices": [["cpu"]], "denoiser_devices": [[0, 1]], "denoiser_sp": 2}
    assert role_devices(kwargs) == {Role.PROMPT_ENCODER: [["cpu"]], Role.DENOISER: [[0, 1]]}
    assert kwargs == {"denoiser_sp": 2}
    with pytest.raises(TypeError, match="server_devices names no worker role; use encoder_devices"):
        role_devices({"server_devices": [["cpu"]]})


def test_serve_flags_become_triptych_serve_arguments() -> None:
    assert serve_flags_argv({"denoiser_sp": 4, "simulate": True, "disagg_insecure": False}) == [
        "--denoiser-sp", "4", "--simulate",
    ]  # fmt: skip
    with pytest.raises(TypeError, match="not_a_flag=1 is not a `triptych serve` flag"):
        serve_flags_argv({"not_a_flag": 1})


def test_devices_are_cpu_or_gpu_indices() -> None:
    assert device_flags(["cpu"]) == (["--device", "cpu"], {})
    flags, env = device_flags([4, 5])
    assert flags[:4] == ["--device", "cuda", "--num-gpus", "2"] and env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert flags[4] == "--master-port" and 1 <= int(flags[5]) <= 65535  # an instance's own rendezvous port
    assert device_flags(["cpu", "cpu"])[0][:4] == ["--device", "cpu", "--num-gpus", "2"]  # two CPU ranks
    for bad in ([], ["gpu0"], [-1], [True], ["cpu", 1]):
        with pytest.raises(ValueError, match="give"):
            device_flags(bad)
    with pytest.raises(ValueError, match="a GPU index appears twice"):
        device_flags([1, 1])


def test_the_specs_gpus_arguments_are_the_devices_arguments() -> None:
    kwargs = {"encoder_gpus": [[0]], "denoiser_gpus": [[1, 2, 3, 4], [5, 6, 7, 8]], "decoder_gpus": [[0]]}
    assert role_devices(kwargs) == {
        Role.ENCODER: [[0]],
        Role.DENOISER: [[1, 2, 3, 4], [5, 6, 7, 8]],
        Role.DECODER: [[0]],
    }
    with pytest.raises(TypeError, match="denoiser_devices and denoiser_gpus are the same argument"):
        role_devices({"denoiser_devices": [[0]], "denoiser_gpus": [[1]]})


def test_on_cpu_gpu_index_lists_become_cpu_ranks() -> None:
    assert role_devices({"denoiser_gpus": [[1, 2], [3, 4]]}, cpu=True) == {
        Role.DENOISER: [["cpu", "cpu"], ["cpu", "cpu"]]
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], r"denoiser_gpus=\[\]: give a list of instances"),
        ("0,1", r"denoiser_gpus='0,1': give a list of instances"),
        ([[0, 1], 2], r"denoiser_gpus\[1\]=2: an instance is a list of devices"),
        ([[0, 1], [2, "x"]], r"denoiser_gpus\[1\]: devices \[2, 'x'\]: give"),
        ([[0, 0]], r"denoiser_gpus\[0\]: devices \[0, 0\]: a GPU index appears twice"),
    ],
)
def test_a_bad_device_list_is_refused_naming_the_argument(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        role_devices({"denoiser_gpus": value})


def test_one_master_port_for_several_multi_device_instances_is_refused(tmp_path) -> None:
    pool = triptych_dev.launch_pool(tmp_path, denoiser_gpus=[[0, 1], [2, 3]], master_port=29500)
    with pytest.raises(ValueError, match="master_port=29500: every multi-device instance"), pool:
        pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"encoder_devices": [["cpu"]], "prompt_encoder_devices": [["cpu"]]}, "not both"),
        ({"image_encoder_devices": [["cpu"]]}, "needs prompt_encoder_devices"),
        ({"full_pipeline": True, "decoder_devices": [["cpu"]]}, "full_pipeline=True runs denoiser_devices only"),
    ],
)
def test_contradictory_topologies_are_refused_before_anything_starts(tmp_path, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message), triptych_dev.launch_pool(tmp_path, **kwargs):
        pass


def test_a_full_pipeline_pool_is_denoisers_only() -> None:
    from triptych.roles import Role
    from triptych_dev.pool import pool_devices

    assert pool_devices({}, full_pipeline=True) == {Role.DENOISER: [("cpu",)]}
    assert pool_devices({Role.DENOISER: [[0], [1]]}, full_pipeline=True) == {Role.DENOISER: [[0], [1]]}


def test_each_flag_reaches_only_the_processes_that_take_it() -> None:
    from triptych_dev.pool import route_flags

    routed = route_flags({
        "cfg_parallel_size": 2, "denoiser_sp": 2, "encoder_tp": 1, "disagg_dispatch_policy": "max_free_slots",
        "disagg_transfer_pool_size": "64MiB", "device": "cpu", "batching_mode": "dynamic",
        "encoder_cache_bytes": "1MiB",
    })  # fmt: skip
    # device is the workers' alone: the head runs no model, and refuses it (triptych.flag_roles)
    assert routed.head == {"disagg_dispatch_policy": "max_free_slots", "batching_mode": "dynamic"}
    # batching_mode is the head's alone: a worker refuses it (triptych.flag_roles)
    assert routed.workers == {"cfg_parallel_size": 2, "disagg_transfer_pool_size": "64MiB", "device": "cpu"}
    # the prompt cache: only the roles that encode prompts (a full-pipeline denoiser among them)
    cache = {"encoder_cache_bytes": "1MiB"}
    assert routed.roles == {
        Role.DENOISER: {"denoiser_sp": 2, **cache},
        Role.ENCODER: {"encoder_tp": 1, **cache},
        Role.PROMPT_ENCODER: cache,
    }
    with pytest.raises(TypeError, match="cfg_parallel=2 is not a `triptych serve` flag"):
        route_flags({"cfg_parallel": 2})


def test_serve_args_from_kwargs_takes_flags_by_name_and_names_a_wrong_one() -> None:
    from triptych.config import ServeArgs

    args = ServeArgs.from_kwargs(model_path="m", denoiser_sp=4, disagg_ib_device="mlx5_0")
    assert (args.model_path, args.denoiser_sp, args.disagg_ib_device) == ("m", 4, "mlx5_0")
    with pytest.raises(TypeError, match="'denoiser_spp' is not a `triptych serve` flag"):
        ServeArgs.from_kwargs(model_path="m", denoiser_spp=4)
