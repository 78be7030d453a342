"""`pdserve up` configuration and process helpers, without starting a cluster."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launcher.actuators import NodeLaunch
from launcher.cluster_config import ClusterConfig
from launcher.processes import child_env, connect_host, kill_marked, marked_pids, parse_ready
from pdserve_cli import build_parser
from router.autoscale.policy import Pool


def config(*argv: str) -> ClusterConfig:
    return ClusterConfig.from_args(build_parser().parse_args(["up", *argv]))


def test_defaults_bind_loopback_and_use_a_shm_arena() -> None:
    c = config()
    assert (c.host, c.port, c.grpc_port, c.kv_store, c.model) == (
        "127.0.0.1", 8000, 50051, "shm", "tiny-llama",
    )  # fmt: skip
    assert c.kv_store_capacity == "auto"
    assert config("--kv-store", "redis+cluster://127.0.0.1:7000").kv_store.startswith("redis+")
    assert (c.prefill, c.decode, c.autoscale, c.demo) == (1, 1, False, False)


def test_cpu_nodes_get_one_thread_and_user_flags_last() -> None:
    c = config("--device", "cpu", "--node-args", "--max-num-seqs 4")
    assert c.node_argv() == ["--device", "cpu", "--cpu-threads", "1", "--max-num-seqs", "4"]


def test_gpu_nodes_sharing_a_gpu_get_a_kv_budget() -> None:
    shared = config("--device", "cuda", "--prefill", "2", "--decode", "2")
    assert shared.node_argv() == ["--device", "cuda", "--kv-cache-memory-gb", "4"]
    own = config("--device", "cuda", "--gpus", "0,1", "--prefill", "1", "--decode", "1")
    assert own.gpus == ("0", "1") and own.node_argv() == ["--device", "cuda"]
    sized = config("--device", "cuda", "--kv-cache-gb", "12.5")
    assert sized.node_argv()[-2:] == ["--kv-cache-memory-gb", "12.5"]


def test_tp_nodes_count_their_gpus() -> None:
    """A TP=2 prefill node takes two GPUs: 1 prefill + 1 decode fit 4 GPUs without sharing;
    autoscaled up to 4 + 4 they would not, so each node's cache is bounded."""
    c = config("--device", "cuda", "--gpus", "0,1,2,3", "--prefill-tp", "2")
    assert (c.prefill_tp, c.decode_tp, c.max_gpu_slots()) == (2, 1, 3)
    assert c.node_argv() == ["--device", "cuda"]
    scaled = config("--device", "cuda", "--gpus", "0,1,2,3", "--prefill-tp", "2", "--autoscale")
    assert scaled.max_gpu_slots() == 4 * 2 + 4 * 1
    assert scaled.node_argv()[-2:] == ["--kv-cache-memory-gb", "4"]
    assert config("--device", "cpu", "--decode-tp", "2").gpu_ids() == ()  # CPU: gloo ranks


def test_up_keeps_to_the_gpus_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """No --gpus: the GPUs of up's own CUDA_VISIBLE_DEVICES, not every device node."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert config("--device", "cuda").gpu_ids() == ("2", "3")
    assert config("--device", "cuda", "--gpus", "5").gpu_ids() == ("5",)


def test_the_router_autoscaler_counts_gpus_and_starts_tp_nodes(tmp_path: Path) -> None:
    from bench.slo import SLOConfig
    from router.autoscale.config import AutoscaleSettings, add_autoscale_arguments, build_actuator

    parser = argparse.ArgumentParser()
    add_autoscale_arguments(parser)
    args = parser.parse_args(
        ["--autoscale", "--node-kv-store", "shm://x", "--node-gpus", "0,1,2,3",
         "--prefill-tp", "2", "--node-log-dir", str(tmp_path)]
    )  # fmt: skip
    settings = AutoscaleSettings.from_args(args, SLOConfig())
    assert settings is not None
    policy = settings.policy
    assert (policy.prefill_gpus, policy.decode_gpus, policy.gpu_budget) == (2, 1, 4)
    actuator = build_actuator(settings, "127.0.0.1:1", "tiny-llama")
    assert actuator.launch.tp_size(Pool.PREFILL) == 2  # type: ignore[attr-defined]
    assert "--tensor-parallel-size" in actuator.launch.argv(Pool.PREFILL)  # type: ignore[attr-defined]


def test_the_store_is_sized_after_the_node_caches_unless_given() -> None:
    assert config("--device", "cpu").store_capacity() == "1GiB"
    assert config("--device", "cuda").store_capacity() == "4GiB"
    assert config("--device", "cpu", "--kv-cache-gb", "1.5").store_capacity() == "3GiB"
    assert config("--kv-store-capacity", "8GiB").store_capacity() == "8GiB"


def test_demo_takes_free_ports_unless_told() -> None:
    assert (config("--demo").port, config("--demo").grpc_port) == (0, 0)
    assert (config().port, config().grpc_port) == (8000, 50051)
    assert config("--demo", "--port", "9000").port == 9000


SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'
ENGINE_FLAGS = {  # vLLM flag -> the value given to `up`, and the node option it must become
    "--max-model-len": ("512", "max_model_len", 512),
    "--block-size": ("32", "block_size", 32),
    "--dtype": ("half", "dtype", "float16"),  # vLLM's alias, spelled the engine's way
    "--max-num-seqs": ("8", "max_num_seqs", 8),
    "--max-num-batched-tokens": ("1024", "max_num_batched_tokens", 1024),
    "--gpu-memory-utilization": ("0.5", "gpu_memory_utilization", 0.5),
    "--speculative-config": (SPEC, "speculative_config", SPEC),
    "--seed": ("7", "seed", 7),
}


def test_every_engine_flag_reaches_the_node_command_line() -> None:
    from node_frontend.options import add_node_arguments, options_from_args

    argv = [x for flag, (value, _, _) in ENGINE_FLAGS.items() for x in (flag, value)]
    c = config("--device", "cpu", "--enforce-eager", *argv, "--node-args", "--max-num-seqs 4")
    launch = NodeLaunch(router="127.0.0.1:1", kv_store="shm:///x", log_dir=Path("/tmp"),
                        extra_args=tuple(c.node_argv()))  # fmt: skip
    node_argv = launch.argv(Pool.PREFILL)
    assert node_argv[node_argv.index("--max-model-len") + 1] == "512"
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, default_port=0)
    assert "--kv-store" not in node_argv  # through the environment: a URL may hold a password
    options = options_from_args(parser.parse_args(node_argv[4:]), 0, env={"kv_store": "shm:///x"})
    for _, name, expected in ENGINE_FLAGS.values():
        if name != "max_num_seqs":
            assert getattr(options, name) == expected, name
    assert options.max_num_seqs == 4  # --node-args comes last: it still overrides
    assert options.enforce_eager is True and options.device == "cpu"
    engine = options.engine_config("producer")  # the engine takes every one of them
    assert (engine.model.max_model_len, engine.cache.block_size) == (512, 32)
    assert engine.cache.gpu_memory_utilization == 0.5
    # speculation is the decode engine's: a prefill samples one token
    assert engine.speculative_config is None
    decode = options.engine_config("consumer")
    assert decode.speculative_config is not None
    assert decode.speculative_config.num_speculative_tokens == 2


def test_serving_flags_reach_the_router() -> None:
    from router.config import RouterConfig, add_arguments

    c = config("--served-model-name", "my-model", "--api-key", "k", "--max-model-len", "512")
    assert c.router_argv() == ["--served-model-name", "my-model"]  # the key goes by env
    assert c.served_name == "my-model" and config().served_name == "tiny-llama"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    routed = RouterConfig.from_args(parser.parse_args(["--model", c.model, *c.router_argv()]))
    assert routed.served_model_name == "my-model"


def test_vllm_flags_up_takes() -> None:
    """The flags a vLLM user types: each parsed and carried to the nodes or the router."""
    from node_frontend.options import add_node_arguments, options_from_args
    from router.config import RouterConfig, add_arguments

    tp = config("--device", "cpu", "-tp", "2")
    assert (tp.prefill_tp, tp.decode_tp) == (2, 2)
    mixed = config("--device", "cpu", "--tensor-parallel-size", "2", "--decode-tp", "1")
    assert (mixed.prefill_tp, mixed.decode_tp) == (2, 1)  # a pool flag wins over -tp
    assert (config().prefill_tp, config().decode_tp) == (1, 1)
    c = config(
        "--device", "cpu", "--seed", "3", "--no-enable-prefix-caching", "--async-scheduling",
        "--trust-remote-code", "--kv-cache-dtype", "auto",
    )  # fmt: skip
    argv = c.node_argv()
    assert argv[argv.index("--seed") + 1] == "3"
    assert argv[argv.index("--enable-prefix-caching") + 1] == "false"
    assert "--async-scheduling" in argv and "--trust-remote-code" not in argv
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, default_port=0)
    options = options_from_args(parser.parse_args([*argv, "--kv-store", "shm:///x"]), 0, env={})
    engine = options.engine_config("consumer")
    assert (engine.model.seed, engine.cache.enable_prefix_caching) == (3, False)
    assert engine.async_scheduling is True
    assert "--enable-prefix-caching" not in config("--device", "cpu").node_argv()
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e5m2: not supported"):
        config("--kv-cache-dtype", "fp8_e5m2")
    fp8 = config("--device", "cpu", "--kv-cache-dtype", "fp8").node_argv()
    options = options_from_args(parser.parse_args([*fp8, "--kv-store", "shm:///x"]), 0, env={})
    assert options.engine_config("consumer").cache.kv_cache_dtype == "fp8"
    names = config("--served-model-name", "a", "b")
    assert names.served_name == "a" and names.router_argv() == ["--served-model-name", "a", "b"]
    router_parser = argparse.ArgumentParser()
    add_arguments(router_parser)
    routed = RouterConfig.from_args(router_parser.parse_args(names.router_argv()))
    assert (routed.served_model_name, routed.served_model_aliases) == ("a", ("b",))


def test_up_serves_lora_adapters_on_every_node(tmp_path) -> None:
    """`up --enable-lora --lora-modules a=dir …`: every node serves them (paths absolute, read
    and checked by the node at start-up), with vLLM's --max-loras / --max-lora-rank."""
    from common.models.names import resolve_model_path
    from node_frontend.options import add_node_arguments, options_from_args
    from tests.lora.adapters import ADAPTERS, write_adapter

    adapter = write_adapter(
        resolve_model_path("tiny-llama"), tmp_path / "a", 0, **ADAPTERS["alpha"]
    )
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        config("--lora-modules", f"alpha={adapter}")
    c = config("--device", "cpu", "--enable-lora", "--lora-modules", f"alpha={adapter}",
               "--max-loras", "2", "--max-lora-rank", "8")  # fmt: skip
    argv = c.node_argv()
    assert argv[argv.index("--lora-modules") + 1] == f"alpha={adapter.resolve()}"
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, default_port=0)
    options = options_from_args(parser.parse_args([*argv, "--kv-store", "shm:///x"]), 0, env={})
    lora = options.engine_config("consumer").lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 2, 8)
    assert list(options.lora_adapters) == ["alpha"]
    too_small = [*argv, "--max-lora-rank", "4", "--kv-store", "shm:///x"]
    with pytest.raises(ValueError, match="rank 8 is over --max-lora-rank 4"):
        options_from_args(parser.parse_args(too_small), 0, env={})


def test_an_unknown_up_flag_prints_ups_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "up", "--bogus-flag", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("usage: pdserve up ") and "--bogus-flag" in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ("--kv-store", "mongodb://x"),
        ("--kv-store-capacity", "lots"),
        ("--prefill", "0"),
        ("--autoscale", "--prefill-min", "3", "--prefill-max", "2"),
        ("--slo", "ttft=fast"),
        ("--port", "70000"),
        ("--max-model-len", "0"),
        ("--block-size", "24"),
        ("--gpu-memory-utilization", "1.5"),
        ("--gpu-memory-utilization", "nan"),
        ("--max-num-seqs", "0"),
        ("--device", "cuda", "--gpus", "0,1", "--decode-tp", "3"),
        ("--prefill-tp", "0"),
        ("--host", ""),
    ],
)
def test_bad_flags_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        config(*argv)


def test_ready_line_and_connect_host() -> None:
    assert parse_ready("PDSERVE_READY http_port=1 grpc_port=2\n") == {
        "http_port": "1",
        "grpc_port": "2",
    }
    assert parse_ready("INFO something else") is None
    assert [connect_host(h) for h in ("0.0.0.0", "::", "10.0.0.5", "fe80::1")] == [
        "127.0.0.1", "[::1]", "10.0.0.5", "[fe80::1]",
    ]  # fmt: skip


def test_child_env_scrubs_pdserve_variables_but_the_cache_dir() -> None:
    base = {"PDSERVE_PREFILL": "2", "PDSERVE_CACHE_DIR": "/c", "PATH": "/bin"}
    env = child_env("m1", base, scrub_pdserve=True, PDSERVE_API_KEY="k")
    expected = {"PDSERVE_CACHE_DIR": "/c", "PATH": "/bin", "_PDSERVE_CLUSTER": "m1"}
    assert env == {**expected, "PDSERVE_API_KEY": "k"}


CHILD_WITH_GRANDCHILD = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""


def test_kill_marked_finds_descendants_by_their_environment() -> None:
    marker = uuid.uuid4().hex
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD_WITH_GRANDCHILD], env=child_env(marker), start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60.0
        while len(marked_pids(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the grandchild to exist
        assert len(marked_pids(marker)) == 2
        assert len(kill_marked(marker)) == 2
    finally:
        kill_marked(marker)
        parent.wait()
    assert marked_pids(marker) == []


def test_kill_marked_grace_lets_stragglers_exit_and_kills_the_rest() -> None:
    marker = uuid.uuid4().hex
    quick = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.5)"], env=child_env(marker)
    )
    try:
        assert kill_marked(marker, grace_s=30.0) == []  # it left on its own within the grace
        assert quick.wait(timeout=5) == 0
        stuck = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env=child_env(marker)
        )
        start = time.monotonic()
        assert kill_marked(marker, grace_s=0.3) == [stuck.pid]
        assert stuck.wait(timeout=5) == -9 and time.monotonic() - start < 10
    finally:
        kill_marked(marker)
    assert marked_pids(marker) == []


SEMAPHORE_HOLDER = """
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, and a resource tracker
print(lock._semlock.name, flush=True)
time.sleep(600)
"""


def test_kill_marked_lets_a_resource_tracker_remove_what_its_processes_left() -> None:
    marker = uuid.uuid4().hex
    holder = subprocess.Popen(
        [sys.executable, "-c", SEMAPHORE_HOLDER], env=child_env(marker), stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        semaphore = Path("/dev/shm") / f"sem.{holder.stdout.readline().strip().lstrip('/')}"
        deadline = time.monotonic() + 30.0
        while len(marked_pids(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the tracker may still be between fork and exec on a loaded box
        assert semaphore.exists() and len(marked_pids(marker)) == 2  # the holder, its tracker
        assert kill_marked(marker) == [holder.pid]  # the tracker left on its own, cleaning up
        assert not semaphore.exists()
    finally:
        kill_marked(marker)
        holder.wait()
