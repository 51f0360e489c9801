"""Locked down: weight payloads are unpickled through an allow-list, so a hostile one runs nothing
(both payload shapes), while real payloads of every dtype still load; the API key guards every
endpoint but /health*, is never echoed, and a non-loopback bind refuses to start without one; the
body limit and the allowed weight directories come from their flags, environment and the fleet."""

from __future__ import annotations

import base64
import io
import os
import pickle

import pytest
import torch

from megarl.procs.net import is_loopback
from megarl.rollout.server.app import create_app, main
from megarl.rollout.server.auth import resolve_api_key
from megarl.wire.safe_unpickle import RefusedGlobal, safe_loads
from megarl.wire.weights_codec import serialize, serialize_flattened_bucket, serialize_named_tensors

torch.set_num_threads(1)
PROMPT = [2, 10, 11, 12, 13, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


# ---- weight payloads ----------------------------------------------------------------------------------
class _CreatesFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class _RunsCommand:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("evil", [_CreatesFile, _RunsCommand])
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_a_payload_that_would_run_code_is_refused_and_runs_nothing(client, tmp_path, evil, load_format):
    marker = tmp_path / "pwned"
    obj = (
        [("lm_head.weight", evil(marker))]
        if load_format is None
        else {"flattened_tensor": evil(marker), "metadata": []}
    )
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    response = client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [payload], "load_format": load_format, "abort_all_requests": True},
    )
    assert response.status_code == 400 and not response.json()["success"]
    refused = f"{open.__module__}.open" if evil is _CreatesFile else f"{os.system.__module__}.system"
    assert refused in response.json()["message"]
    assert not marker.exists()


def test_real_payloads_of_every_dtype_and_view_load_through_the_allow_list():
    base = torch.randn(4, 6)
    named = [
        ("f32", base),
        ("view", base[1:, ::2]),
        ("t", base.t()),
        ("bf16", base.bfloat16()),
        ("f16", base.half()),
        ("i64", torch.arange(5)),
        ("bool", base > 0),
        ("empty", torch.empty(0)),
        ("param", torch.nn.Parameter(torch.ones(3))),
        ("scalar", torch.tensor(2.0)),
    ]
    for name, tensor in safe_loads(base64.b64decode(serialize_named_tensors(named))):
        assert torch.equal(tensor, dict(named)[name]), name
    bucket = safe_loads(base64.b64decode(serialize_flattened_bucket(named[:7])))
    assert bucket["flattened_tensor"].dtype == torch.uint8 and len(bucket["metadata"]) == 7
    assert safe_loads(base64.b64decode(serialize({"nested": [torch.zeros(2)]})))["nested"][0].shape == (2,)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # what a CUDA IPC payload names

    cuda_globals = (rebuild_cuda_tensor, torch.Tensor, type(torch.zeros(1)._typed_storage()), torch.bfloat16)
    assert safe_loads(pickle.dumps(cuda_globals)) == cuda_globals


def test_torchs_file_descriptor_handles_are_refused_with_the_reason():
    from multiprocessing.reduction import ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("x", torch.zeros(3))])
    with pytest.raises(RefusedGlobal, match="rebuild_storage_fd .*file_descriptor sharing strategy"):
        safe_loads(buffer.getvalue())


# ---- API key ------------------------------------------------------------------------------------------
def test_api_key_guards_every_endpoint_but_health_and_is_never_echoed(engine):
    from fastapi.testclient import TestClient

    key = "k3y-" + "x" * 20
    guarded = TestClient(create_app(engine, {"api_key": key, "host": "127.0.0.1"}, api_key=key))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
        response = guarded.post("/generate", json={"input_ids": PROMPT}, headers=headers)
        assert response.status_code == 401 and key not in response.text
        assert guarded.get("/get_server_info", headers=headers).status_code == 401
        assert guarded.post("/update_weights_from_tensor", json={}, headers=headers).status_code == 401
    assert guarded.get("/health").status_code == 200 and guarded.get("/health_generate").status_code == 200
    auth = {"Authorization": f"Bearer {key}"}
    answer = guarded.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, headers=auth)
    assert answer.status_code == 200
    info = guarded.get("/get_server_info", headers=auth)
    assert info.status_code == 200 and key not in info.text and info.json()["api_key"] == "<set>"


def test_api_key_source_and_loopback_rule(monkeypatch, capsys):
    monkeypatch.setenv("MEGARL_ROLLOUT_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
    monkeypatch.setenv("MEGARL_ROLLOUT_API_KEY", "")
    assert resolve_api_key(None) is None
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "rollout-node-3"))
    with pytest.raises(SystemExit) as exit_info:  # refused before any model is loaded
        main(["--model-path", "/nonexistent", "--host", "0.0.0.0"])
    assert exit_info.value.code == 2 and "MEGARL_ROLLOUT_API_KEY" in capsys.readouterr().err


# ---- body limit and weight directories: where the flags come from ------------------------------------
def test_weight_dirs_come_from_the_flag_then_the_environment_then_the_model_path(monkeypatch, tmp_path):
    from megarl.rollout.server.weight_dirs import PathNotAllowed, confine, resolve_weight_dirs

    monkeypatch.setenv("MEGARL_ROLLOUT_WEIGHT_DIRS", f"{tmp_path}/a, {tmp_path}/b")
    assert resolve_weight_dirs("/x,/y", "/model") == ["/x", "/y"]
    assert resolve_weight_dirs(None, "/model") == [f"{tmp_path}/a", f"{tmp_path}/b"]
    monkeypatch.delenv("MEGARL_ROLLOUT_WEIGHT_DIRS")
    assert resolve_weight_dirs(None, "/model") == ["/model"]
    (tmp_path / "a" / "ckpt").mkdir(parents=True)
    (tmp_path / "b").symlink_to(tmp_path / "a")  # an allowed dir may itself be a link
    assert confine(f"{tmp_path}/b/ckpt", [f"{tmp_path}/b"]) == str(tmp_path / "a" / "ckpt")
    with pytest.raises(PathNotAllowed, match=f"allowed directories: {tmp_path}/a .*--weight-dirs"):
        confine(f"{tmp_path}/a/../a2", [f"{tmp_path}/a"])


def test_bad_limits_are_refused_before_any_model_is_loaded(capsys):
    for value in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--model-path", "/nonexistent", "--max-body-mb", value])
        assert exit_info.value.code == 2 and "--max-body-mb" in capsys.readouterr().err


def test_the_fleet_passes_the_disk_transports_directory_and_the_launcher_the_flags(tmp_path):
    from megarl.config import RunConfig
    from megarl.rollout.fleet.engine_launcher import EngineNodeSpec, _limit_args
    from megarl.trainer.runtime import engine_node_specs

    specs = [s for engine in engine_node_specs(RunConfig(), "/model", tmp_path) for s in engine]
    assert specs and all(s.weight_dirs == (str(tmp_path / "weights"),) for s in specs)
    spec = EngineNodeSpec("embedded", "/model", 0, weight_dirs=("/a", "/b"), max_body_mb=8.0)
    assert _limit_args(spec) == ["--weight-dirs", "/a,/b", "--max-body-mb", "8.0"]
    assert _limit_args(EngineNodeSpec("embedded", "/model", 0)) == []
