"""python -m rlfleet.vllm's arguments: vLLM's own engine arguments, --config YAML, rlfleet's
flags beside them, the settings rlfleet enforces; advertised addresses."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlfleet.runtime import address
from rlfleet.vllm.args import EXTENSION, engine_args, own_transfer_backend, parse_args


def test_config_yaml_is_read_and_the_command_line_wins(tmp_path: Path) -> None:
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("model: /models/policy\ntensor-parallel-size: 2\npipeline-parallel-size: 2\n"
                   "gpu-memory-utilization: 0.8\nmax-num-seqs: 64\nenforce-eager: true\n"
                   "enable-prefix-caching: false\nenable-rl: true\nsystem-port: 8081\n"
                   "advertise-host: 10.1.2.3\ndtype: bfloat16\n")
    args = parse_args(["--config", str(cfg), "--max-num-seqs", "32"])
    assert args.model == "/models/policy" and args.enable_rl and args.system_port == 8081
    assert args.advertise_host == "10.1.2.3" and args.max_num_seqs == 32  # CLI beats YAML
    ea = engine_args(args)
    assert (ea.tensor_parallel_size, ea.pipeline_parallel_size) == (2, 2)
    assert ea.gpu_memory_utilization == 0.8 and ea.enforce_eager and ea.dtype == "bfloat16"
    assert ea.enable_prefix_caching is False
    assert parse_args([f"--config={cfg}"]).tensor_parallel_size == 2  # the `=` form too


def test_rlfleet_defaults_and_the_served_name() -> None:
    ea = engine_args(parse_args(["--model", "Qwen/Qwen3-0.6B"]))
    assert ea.served_model_name == ["Qwen/Qwen3-0.6B"]  # the whole string, as vLLM serves it
    assert ea.logprobs_mode == "processed_logprobs" and ea.max_logprobs == 20
    assert ea.worker_extension_cls == EXTENSION
    # the flags the suite has always passed keep working
    ea = engine_args(parse_args(["--model", "m", "--served-model-name", "tiny", "--dtype",
                                 "float32", "--max-model-len", "2048", "--enforce-eager",
                                 "--logprobs-mode", "raw_logprobs"]))
    assert ea.served_model_name == ["tiny"] and ea.max_model_len == 2048
    assert ea.logprobs_mode == "raw_logprobs"


def test_weight_transfer_config_on_the_cpu_build() -> None:
    """modelexpress: the worker runs it (vLLM's engine gets no config); any other backend is
    vLLM's, passed as given (a GPU build passes modelexpress too: own_transfer_backend)."""
    mx = parse_args(["--model", "m", "--weight-transfer-config", '{"backend": "modelexpress"}'])
    assert own_transfer_backend(mx) == "modelexpress"
    assert engine_args(mx).weight_transfer_config is None
    nccl = parse_args(["--model", "m", "--weight-transfer-config", '{"backend": "nccl"}'])
    assert own_transfer_backend(nccl) is None
    assert engine_args(nccl).weight_transfer_config.backend == "nccl"
    assert own_transfer_backend(parse_args(["--model", "m"])) is None


def test_a_gpu_build_leaves_modelexpress_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlfleet.vllm.args as worker_args

    monkeypatch.setattr(worker_args, "current_platform", argparse.Namespace(is_cpu=lambda: False))
    mx = parse_args(["--model", "m", "--weight-transfer-config", '{"backend": "modelexpress"}'])
    assert own_transfer_backend(mx) is None
    assert engine_args(mx).weight_transfer_config.backend == "modelexpress"


def test_served_name_of_a_local_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model Qwen/Qwen3-0.6B`, a local directory of that name, is served under that name."""
    from rlfleet.vllm.engine import VllmEngine

    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    engine = VllmEngine(parse_args(["--model", "Qwen/Qwen3-0.6B"]))
    assert engine.info.served_model_name == "Qwen/Qwen3-0.6B"
    assert engine.info.model_path == str(tmp_path / "Qwen" / "Qwen3-0.6B")
    assert engine.engine_args().served_model_name == ["Qwen/Qwen3-0.6B"]


@pytest.mark.parametrize("flags, words", [
    (["--logprobs-mode", "raw_logits"], "log-probabilities"),
    (["--max-logprobs", "5"], "at least 20"),
    (["--skip-tokenizer-init"], "tokenizer"),
    (["--served-model-name", "a", "b"], "one name"),
    (["--worker-extension-cls", "collections.OrderedDict"], "subclass"),
    (["--worker-extension-cls", "no.such.Module"], "cannot import"),
])
def test_enforced_settings_are_refused_with_a_reason(flags, words, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", *flags])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_advertised_address(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in address.HOST_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert address.advertised_host("127.0.0.1") == "127.0.0.1"
    assert address.advertised_host("0.0.0.0", explicit="node-3.example") == "node-3.example"
    assert address.advertised_host("10.9.8.7") == "10.9.8.7"  # a specific bind is advertised
    # bound to all interfaces: the interface that routes to the discovery store
    assert address.advertised_host("0.0.0.0", toward=("127.0.0.1", 2379)) == "127.0.0.1"
    monkeypatch.setenv("POD_IP", "10.0.0.9")
    assert address.advertised_host("0.0.0.0", toward=("127.0.0.1", 2379)) == "10.0.0.9"
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.8")
    assert address.advertised_host("0.0.0.0") == "10.0.0.8"
    assert address.http_url("::1", 80) == "http://[::1]:80"
    assert address.discovery_peer("etcd://10.1.1.1:2379,10.1.1.2:2379") == ("10.1.1.1", 2379)
    assert address.discovery_peer("file:///tmp/x") is None


def test_etcd_endpoints_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfleet.runtime.discovery import EtcdDiscovery, default_discovery_url, open_discovery

    monkeypatch.delenv("RLFLEET_DISCOVERY", raising=False)
    monkeypatch.setenv("ETCD_ENDPOINTS", "http://10.0.0.1:2379, 10.0.0.2:2380")
    assert default_discovery_url() == "etcd://10.0.0.1:2379,10.0.0.2:2380"
    d = open_discovery()
    assert isinstance(d, EtcdDiscovery) and d.endpoints == [("10.0.0.1", 2379), ("10.0.0.2", 2380)]
    monkeypatch.setenv("RLFLEET_DISCOVERY", "etcd://10.0.0.5:1")  # rlfleet's own wins
    assert default_discovery_url() == "etcd://10.0.0.5:1"
    monkeypatch.delenv("RLFLEET_DISCOVERY")
    monkeypatch.setenv("ETCD_ENDPOINTS", "ftp://x")
    with pytest.raises(ValueError, match="ETCD_ENDPOINTS"):
        default_discovery_url()


def test_frontend_http_port_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfleet.frontend.__main__ import parse_args as frontend_args

    monkeypatch.setenv("DYN_HTTP_PORT", "9123")
    assert frontend_args([]).http_port == 9123
    assert frontend_args(["--http-port", "1"]).http_port == 1
    assert frontend_args(["--advertise-host", "h"]).advertise_host == "h"


def test_local_address_toward_a_worker() -> None:
    assert address.local_address_toward("http://127.0.0.1:8081") == "127.0.0.1"
    assert address.local_address_toward("not a url") is None


def test_fleet_spec_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fleet.yaml → the members `rlfleet up` starts; a vLLM worker holds TP x PP GPUs."""
    from rlfleet.runtime import launch

    monkeypatch.setattr(launch, "_gpu_engine", lambda: True)
    for var in ("RLFLEET_DISCOVERY", "ETCD_ENDPOINTS"):
        monkeypatch.delenv(var, raising=False)
    cfg = {"discovery": "etcd://10.0.0.1:2379", "frontend": {"http-port": 0, "enable-rl": True},
           "workers": [{"kind": "vllm", "count": 2,
                        "args": {"model": "m", "tensor-parallel-size": 2,
                                 "pipeline-parallel-size": 2, "enable-rl": True,
                                 "enforce-eager": False, "allowed-weights-root": ["/a", "/b"]}},
                       {"kind": "mocker", "args": ["--token-delay", "0.1"]}]}
    spec = launch.FleetSpec.load(cfg, state_dir=tmp_path)
    assert [w.name for w in spec.workers] == ["worker-0", "worker-1", "worker-2"]
    assert [w.gpus for w in spec.workers] == [4, 4, 0]
    assert spec.workers[0].args == ["--discovery", "etcd://10.0.0.1:2379", "--namespace",
                                    spec.namespace, "--model", "m", "--tensor-parallel-size",
                                    "2", "--pipeline-parallel-size", "2", "--enable-rl",
                                    "--allowed-weights-root", "/a", "--allowed-weights-root",
                                    "/b"]
    assert spec.frontend.args[-3:] == ["--http-port", "0", "--enable-rl"]
    quick = launch.FleetSpec.load(None, state_dir=tmp_path, kind="mocker", count=3,
                                  worker_args=["--served-model-name", "x"])
    assert len(quick.workers) == 3 and quick.discovery.startswith("file://")
    with pytest.raises(ValueError, match="--model"):
        launch.FleetSpec.load({"workers": [{"kind": "vllm"}]}, state_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown keys"):
        launch.FleetSpec.load({"worker": []}, state_dir=tmp_path)


def test_cpu_workers_of_a_host_each_get_their_share_of_its_cores(tmp_path, monkeypatch):
    """`rlfleet up` on the CPU engine: each single-rank vLLM worker its own block of the
    host's cores (one each in turn past one worker a core), with vLLM's OpenMP settings for a
    bound rank; none for a parallel engine, a mocker, `pin_cores: false`, a GPU engine, or
    cores the environment names already."""
    from rlfleet.runtime import launch

    assert launch.cpu_shares(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert launch.cpu_shares(2, [5, 0, 3, 1, 2]) == ["0,1,2", "3,5"]
    assert launch.cpu_shares(3, [0, 1]) == ["0", "1", "0"]
    assert launch.cpu_shares(0, [0, 1]) == []
    assert launch.pinned_env("0-3,6") == {launch.CPU_BIND: "0-3,6", "OMP_NUM_THREADS": "5",
                                          "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}
    monkeypatch.setattr(launch, "_gpu_engine", lambda: False)
    monkeypatch.setattr(launch, "cpu_shares", lambda n: [str(10 + i) for i in range(n)])
    monkeypatch.delenv(launch.CPU_BIND, raising=False)
    cfg = {"workers": [{"kind": "vllm", "count": 2, "args": {"model": "m"}},
                       {"kind": "vllm", "args": {"model": "m", "tensor-parallel-size": 2}},
                       {"kind": "mocker"},
                       {"kind": "vllm", "args": {"model": "m"}, "pin_cores": False},
                       {"kind": "vllm", "args": {"model": "m"}}]}
    spec = launch.FleetSpec.load(cfg, state_dir=tmp_path)
    assert all(not w.env for w in spec.workers)  # Ray places them: its nodes, not this host
    launch.pin_cores(spec.workers)  # as up_local starts them on this host
    got = [w.env.get(launch.CPU_BIND) for w in spec.workers]
    assert got == ["10", "11", None, None, None, "12"]
    assert spec.workers[0].env["KMP_BLOCKTIME"] == "5"
    assert launch.CPU_BIND not in spec.frontend.env
    def pinned_again() -> list:
        spec = launch.FleetSpec.load(cfg, state_dir=tmp_path)
        launch.pin_cores(spec.workers)
        return spec.workers

    monkeypatch.setenv(launch.CPU_BIND, "0-1")  # the user's own list: left as it is
    assert all(not w.env for w in pinned_again())
    monkeypatch.delenv(launch.CPU_BIND)
    monkeypatch.setattr(launch, "_gpu_engine", lambda: True)
    assert all(not w.env for w in pinned_again())
    with pytest.raises(ValueError, match="pin_cores is true or false"):
        launch.FleetSpec.load({"workers": [{"kind": "vllm", "args": {"model": "m"},
                                            "pin_cores": "yes"}]}, state_dir=tmp_path)


def test_rlfleet_up_processes_reach_the_frontend_only(tmp_path):
    """`rlfleet up --processes K`: the frontend's --processes, over the config's."""
    from rlfleet.runtime import launch

    cfg = {"frontend": {"http-port": 0, "processes": 4}}
    spec = launch.FleetSpec.load(cfg, state_dir=tmp_path, kind="mocker", count=2,
                                 frontend_processes=2)
    assert spec.frontend.args[-4:] == ["--processes", "4", "--processes", "2"]  # last wins
    assert all("--processes" not in w.args for w in spec.workers)
    assert launch.FleetSpec.load(cfg, state_dir=tmp_path, kind="mocker").frontend.args[-2:] == [
        "--processes", "4"]
    with pytest.raises(ValueError, match="--processes must be at least 1"):
        launch.FleetSpec.load(None, state_dir=tmp_path, frontend_processes=0)


def test_rlfleet_up_hands_every_member_the_admin_token_file(tmp_path):
    """`rlfleet up --admin-token-file F`: the frontend and every worker read the token from
    F (it never appears on a command line); a missing or empty file is refused up front."""
    from rlfleet.cli import build_parser
    from rlfleet.frontend.__main__ import parse_args as frontend_args
    from rlfleet.runtime import launch
    from rlfleet.worker.serve import add_worker_args, settle_worker_args

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = build_parser().parse_args(["up", "--kind", "mocker", "--workers", "2",
                                      "--admin-token-file", str(token)])
    spec = launch.FleetSpec.load(None, state_dir=tmp_path, kind=args.kind, count=args.workers,
                                 admin_token_file=args.admin_token_file)
    for m in [spec.frontend, *spec.workers]:
        i = m.args.index("--admin-token-file")
        assert m.args[i + 1] == str(token.absolute()) and "s3cret" not in m.args
    assert frontend_args(spec.frontend.args).admin_token == "s3cret"
    p = argparse.ArgumentParser()
    add_worker_args(p)
    worker = p.parse_args(spec.workers[0].args)
    settle_worker_args(worker)
    assert worker.admin_token == "s3cret"
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(ValueError, match="--admin-token-file"):
            launch.FleetSpec.load(None, state_dir=tmp_path, kind="mocker",
                                  admin_token_file=str(bad))

