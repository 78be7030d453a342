"""``docker compose up`` for real: compose.yaml + compose.cpu.yaml on this machine's engine.

Run by ``deploy/compose_test.sh``, which builds the images with no registry and sets
``PDSERVE_IMAGE`` / ``PDSERVE_REDIS_IMAGE``; skipped unless ``PDSERVE_COMPOSE_TEST=1``. The tests
share one project (Redis, the router, prefill x1, decode x2) and run in file order, as the
issue lists them: readiness, the offline engine's tokens through the official ``openai`` client
and gRPC, scaling the decode pool by hand under load, then faults under load. Each check that
counts requests adds a row to the summary (``PDSERVE_COMPOSE_REPORT``, Markdown).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from benchmarks.chaos import MAX_TOKENS, PROMPTS
from tests.deploy.compose_project import FILES, REPO, ComposeProject, docker
from tests.deploy.load import Load, Tally

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(
        os.environ.get("PDSERVE_COMPOSE_TEST") != "1",
        reason="live Docker Compose test: run deploy/compose_test.sh",
    ),
]

MODEL = "tiny-llama"
PROJECT = "pdserve-compose-test"
READY_S = 300.0  # cold start of four containers (torch, the tiny model, gcc) on two busy cores
TEXT_PROMPT = "Once upon a time, in a small village by the sea,"
IDS_PROMPT = [1, *range(400, 440)]
ROWS: list[tuple[str, str, Tally | None, float | None]] = []  # (check, replicas, tally, seconds)


def greedy(max_tokens: int = MAX_TOKENS):  # type: ignore[no-untyped-def]
    from common import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def offline():  # type: ignore[no-untyped-def]
    from common import LLM

    return LLM(model=MODEL, device="cpu")


@pytest.fixture(scope="module")
def expected(offline) -> list[str]:  # type: ignore[no-untyped-def]
    """The offline engine's greedy text for each of the load's prompts."""
    return [o.outputs[0].text for o in offline.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeProject]:
    models = tmp_path_factory.mktemp("models")  # mounted at /models: nothing is created in the repo
    env = {**os.environ, "PDSERVE_MODEL": MODEL, "PDSERVE_MODELS_DIR": str(models)}
    project = ComposeProject(PROJECT, env)
    project.down()  # a previous run killed before its teardown
    try:
        start = time.monotonic()
        project.up("--scale", "decode=2")
        ready_s = project.wait_instances(prefill=1, decode=2, timeout_s=READY_S)
        ROWS.append(("`up`, then /ready", "1 prefill, 2 decode", None, time.monotonic() - start))
        assert ready_s < READY_S
        yield project
    finally:
        project.down()
        _write_report()
    assert not leftovers(project), "compose down left these behind"


def leftovers(project: ComposeProject) -> list[str]:
    label = f"label=com.docker.compose.project={project.name}"
    return [
        *docker("ps", "-aq", "--filter", label).split(),
        *docker("network", "ls", "-q", "--filter", label).split(),
        *docker("volume", "ls", "-q", "--filter", label).split(),
    ]


def _row(check: str, replicas: str, tally: Tally | None, seconds: float | None) -> str:
    counts = [tally.requests, tally.failed, tally.truncated + tally.different] if tally else []
    cells = [check, replicas, *(map(str, counts) if tally else ["-"] * 3)]
    return "| " + " | ".join([*cells, "-" if seconds is None else f"{seconds:.1f}"]) + " |"


def _write_report() -> None:
    """The summary: one row per check that counted requests (wrong: truncated or changed)."""
    header = [
        "| check | replicas | requests | failed | wrong | seconds |",
        "|---|---|---|---|---|---|",
    ]
    text = "\n".join([*header, *(_row(*row) for row in ROWS)]) + "\n"
    print("\n" + text)
    if path := os.environ.get("PDSERVE_COMPOSE_REPORT"):
        Path(path).write_text(text)


def client(project: ComposeProject) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{project.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)  # fmt: skip


# -- the offline engine's tokens through the published port ----------------------------------


def test_completions_and_chat_match_the_offline_engine(project: ComposeProject, offline) -> None:  # type: ignore[no-untyped-def]
    api = client(project)
    (want,) = offline.generate([TEXT_PROMPT], greedy(), use_tqdm=False)
    got = api.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == want.outputs[0].text

    messages = [{"role": "user", "content": "Tell me about the weather."}]
    rendered = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    (want,) = offline.generate([prompt_ids], greedy(), use_tqdm=False)
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.choices[0].message.content == want.outputs[0].text


def test_a_streamed_completion_matches(project: ComposeProject, offline) -> None:  # type: ignore[no-untyped-def]
    (want,) = offline.generate([TEXT_PROMPT], greedy(24), use_tqdm=False)
    chunks = list(
        client(project).completions.create(
            model=MODEL, prompt=TEXT_PROMPT, max_tokens=24, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert len(chunks) > 2  # streamed, not one answer
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_grpc_generate_gives_the_offline_token_ids(project: ComposeProject, offline) -> None:  # type: ignore[no-untyped-def]
    (want,) = offline.generate([IDS_PROMPT], greedy(), use_tqdm=False)

    async def generate() -> list[int]:
        async with grpc.aio.insecure_channel(project.grpc_target) as channel:
            message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=IDS_PROMPT))
            message.sampling_params.temperature = 0.0
            message.sampling_params.max_tokens = MAX_TOKENS
            message.sampling_params.ignore_eos = True
            stub = pb_grpc.RouterServiceStub(channel)
            return [t async for item in stub.Generate(message, timeout=120) for t in item.token_ids]

    assert asyncio.run(generate()) == list(want.outputs[0].token_ids)


# -- scaling by hand ----------------------------------------------------------------------------


def test_scale_decode_to_3_and_back_to_1_under_load(
    project: ComposeProject, expected: list[str]
) -> None:
    """`up --scale decode=3`: the router learns the new node; `--scale decode=1`: the two it
    stops deregister and drain (SIGTERM), the router forgets them; no request fails."""
    with Load(project.base_url, expected, streams=4) as load:
        load.wait_requests(8)
        start = time.monotonic()
        project.up("--no-recreate", "--scale", "decode=3")
        project.wait_instances(prefill=1, decode=3, timeout_s=240)
        learned = time.monotonic()
        ROWS.append(("`--scale decode=3`", "2 → 3 decode", load.tally(start, learned),
                     learned - start))  # fmt: skip
        load.wait_requests(8)
        start = time.monotonic()
        project.up("--no-recreate", "--scale", "decode=1")
        project.wait_instances(prefill=1, decode=1, timeout_s=240)
        load.wait_requests(8)
        forgot = time.monotonic()
        ROWS.append(("`--scale decode=1`", "3 → 1 decode", load.tally(start, forgot),
                     forgot - start))  # fmt: skip
    tally = load.tally()
    assert tally.requests > 0 and tally.bad == 0, tally
    project.up("--no-recreate", "--scale", "decode=2")
    project.wait_instances(prefill=1, decode=2, timeout_s=240)


# -- crashes under load -------------------------------------------------------------------------

CRASHES = (
    ("decode", "1 of 2 decode", "streams migrate to the other decode node"),
    ("prefill", "1 of 1 prefill", "decode nodes prefill (fallback) until it is back"),
    ("redis", "1 of 1 Redis", "an empty store: blocks are recomputed"),
)


def crash(container: str) -> None:
    """SIGKILL of the container's main process from the host: a crash, which the restart policy
    answers (``docker kill`` is a manual stop, which ``unless-stopped`` leaves stopped)."""
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", container).strip())
    assert pid > 0, f"{container} is not running"
    os.kill(pid, signal.SIGKILL)


def restarted_and_healthy(container: str, restarts: int) -> bool:
    state = docker("inspect", "-f", "{{.RestartCount}} {{.State.Health.Status}}", container).split()
    return int(state[0]) > restarts and state[1] == "healthy"


@pytest.mark.parametrize(("service", "replicas", "why"), CRASHES, ids=[c[0] for c in CRASHES])
def test_a_crash_under_16_streams_loses_and_changes_nothing(
    project: ComposeProject, expected: list[str], service: str, replicas: str, why: str
) -> None:
    """16 concurrent streamed greedy completions while one container crashes; recovery is from
    the kill until the container is back (its restart policy) and healthy and /ready shows the
    full pools again. No request fails, is cut short or changes (``why`` says how)."""
    (victim,) = project.containers(service)[:1]
    restarts = int(docker("inspect", "-f", "{{.RestartCount}}", victim).strip())
    with Load(project.base_url, expected, streams=16) as load:
        load.wait_requests(16)
        killed = time.monotonic()
        crash(victim)
        deadline = killed + 240
        while not restarted_and_healthy(victim, restarts):
            assert time.monotonic() < deadline, f"{service} not back:\n{project.logs()}"
            time.sleep(0.5)
        project.wait_instances(prefill=1, decode=2, timeout_s=max(1.0, deadline - time.monotonic()))
        recovered = time.monotonic()
        load.wait_requests(16)  # and the load goes on after it
    tally = load.tally(killed)
    ROWS.append((f"crash of {service}", replicas, tally, recovered - killed))
    assert tally.requests > 0 and tally.bad == 0, (why, tally)


# -- network partitions -------------------------------------------------------------------------


def test_network_partitions_cost_speed_never_tokens(
    project: ComposeProject, expected: list[str]
) -> None:
    """Under 8 streams, a decode container is cut off by ``docker network disconnect``: from the
    KV store's network (its loads fail: it recomputes), then from the router's (its streams
    stall, the router moves them to the other decode node and drops it), each time connected
    again (it registers anew, at its address on that network). Nothing fails or changes."""
    victim = project.containers("decode")[0]
    kv, front = project.network("kv"), project.network()
    with Load(project.base_url, expected, streams=8) as load:
        load.wait_requests(8)
        start = time.monotonic()
        docker("network", "disconnect", kv, victim)
        load.wait_requests(24)
        docker("network", "connect", kv, victim)
        healed = time.monotonic()
        ROWS.append(("decode cut from Redis", "1 of 2 decode", load.tally(start, healed),
                     healed - start))  # fmt: skip
        load.wait_requests(8)
        start = time.monotonic()
        docker("network", "disconnect", front, victim)
        project.wait_instances(prefill=1, decode=1, timeout_s=120)  # the router dropped it
        load.wait_requests(16)
        docker("network", "connect", front, victim)
        project.wait_instances(prefill=1, decode=2, timeout_s=120)  # and has it back
        healed = time.monotonic()
        ROWS.append(("decode cut from the router", "1 of 2 decode", load.tally(start, healed),
                     healed - start))  # fmt: skip
        load.wait_requests(8)
    tally = load.tally()
    if tally.bad:  # the router's warnings in the report ("Captured stdout"), not a cut repr
        lines = project.logs(100_000, "router").splitlines()  # its INFO lines drown them
        print("\n".join([line for line in lines if " INFO " not in line][-300:]))
    assert tally.requests > 0 and tally.bad == 0, tally


# -- a shared-file store, TLS to the nodes, an API key --------------------------------------------

API_KEY = "compose-test-key"


def secured(project: ComposeProject, tls_dir: Path) -> ComposeProject:
    """The project with tests/deploy/compose.secure.yaml: the file store on a named volume, TLS
    between the router and the nodes, the API key at the published port."""
    env = {**project.env, "PDSERVE_TLS_DIR": str(tls_dir), "PDSERVE_API_KEY": API_KEY}
    return ComposeProject(project.name, env, ("tests/deploy/compose.secure.yaml",),
                          project.http_port, project.grpc_port)  # fmt: skip


def in_container(container: str, *argv: str) -> tuple[int, str]:
    done = subprocess.run(["docker", "exec", container, *argv], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    return done.returncode, (done.stdout + done.stderr).strip()


def test_tls_a_shared_file_store_and_an_api_key(
    project: ComposeProject, expected: list[str], tmp_path: Path
) -> None:
    """The nodes recreated on the shared-file store (a named volume in every node container),
    serving mutual TLS to the router across containers (certificates made here), with the API
    key at the published port: the offline engine's tokens (so the same as over Redis), entries
    written by prefill and read by decode through the volume, a plaintext or certificate-less
    caller refused by a node, a client without the key refused by the router."""
    from tests.router.test_grpc_api import _write_pki

    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    for path in _write_pki(tls_dir).values():
        path.chmod(0o644)  # the containers' user (uid 10001) reads them
    tls_dir.chmod(0o755)
    secure = secured(project, tls_dir)
    try:
        _check_secured(project, secure, expected)
    finally:  # its volume too (the fixture's `down` knows only the base files)
        secure.down()


def _check_secured(project: ComposeProject, secure: ComposeProject, expected: list[str]) -> None:
    start = time.monotonic()
    secure.up("--scale", "decode=2")  # a changed configuration: every pdserve container anew
    secure.wait_instances(prefill=1, decode=2, timeout_s=READY_S)
    ready = time.monotonic() - start
    keyed = openai.OpenAI(base_url=f"{project.base_url}/v1", api_key=API_KEY, max_retries=0,
                          timeout=120)  # fmt: skip
    texts = [
        keyed.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text
        for prompt in PROMPTS
    ]  # fmt: skip
    assert texts == expected
    with pytest.raises(openai.AuthenticationError):
        client(project).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    decode = secure.containers("decode")[0]
    entry_files = (  # <root>/ab/<30 hex>: one file per entry
        "find /kv -type f -regextype posix-extended -regex '.*/[0-9a-f]{2}/[0-9a-f]{30}' | wc -l"
    )
    code, entries = in_container(decode, "sh", "-c", entry_files)
    assert code == 0 and int(entries) > 0, entries  # what prefill saved, seen from decode
    probe = ["python", "-m", "launcher.health_check", "--grpc", "127.0.0.1:50071"]
    tls = ["--tls-ca", "/tls/ca.pem", "--tls-server-name", "localhost"]
    client_cert = ["--tls-cert", "/tls/client.pem", "--tls-key", "/tls/client-key.pem"]
    assert in_container(decode, *probe, *tls, *client_cert)[0] == 0
    assert in_container(decode, *probe, *tls)[0] != 0  # mutual TLS: no certificate, no call
    assert in_container(decode, *probe)[0] != 0  # plaintext
    ROWS.append(("TLS + file store + API key", "1 prefill, 2 decode", None, ready))


# -- the router's compose actuator ----------------------------------------------------------------


def compose_plugin() -> str:
    """The host's ``docker-compose`` CLI plugin (the one ``docker compose`` runs)."""
    candidates = [Path.home() / ".docker/cli-plugins/docker-compose"] + [
        Path(root) / "docker/cli-plugins/docker-compose"
        for root in ("/usr/local/lib", "/usr/local/libexec", "/usr/lib", "/usr/libexec")
    ]
    return str(next(p for p in candidates if p.exists()))


def autoscaling(project: ComposeProject, env_file: Path) -> ComposeProject:
    """The same project with tests/deploy/compose.autoscale.yaml: its router scales decode."""
    extra = "tests/deploy/compose.autoscale.yaml"
    files = ":".join(str(REPO / name) for name in (*FILES, extra))
    names = ("PDSERVE_IMAGE", "PDSERVE_REDIS_IMAGE", "PDSERVE_MODEL", "PDSERVE_MODELS_DIR",
             "PDSERVE_BIND", "PDSERVE_HTTP_PORT", "PDSERVE_GRPC_PORT")  # fmt: skip
    variables = {name: project.env[name] for name in names} | {
        "COMPOSE_FILE": files, "COMPOSE_PROJECT_NAME": project.name,
        "COMPOSE_ENV_FILES": str(env_file), "COMPOSE_PROJECT_DIR": str(REPO),
        "DOCKER_CLI": os.path.realpath(shutil.which("docker") or "docker"),
        "DOCKER_COMPOSE_PLUGIN": compose_plugin(),
    }  # fmt: skip
    env_file.write_text("".join(f"{k}={v}\n" for k, v in variables.items()))
    return ComposeProject(project.name, {**project.env, **variables}, (extra,),
                          project.http_port, project.grpc_port)  # fmt: skip


def wait_decode(project: ComposeProject, decode: int, timeout_s: float) -> float:
    return project.wait_instances(prefill=1, decode=decode, timeout_s=timeout_s)


def test_the_routers_compose_actuator_scales_decode_with_load(
    project: ComposeProject, expected: list[str], tmp_path: Path
) -> None:
    """Last (its router replaces the project's): ``--autoscale --actuator compose`` with decode
    in [1, 2] and nodes of 2 sequences. 16 streams take decode from 1 to 2 (the router runs
    ``docker compose up --scale decode=2`` in its container); idle takes it back to 1."""
    auto = autoscaling(project, tmp_path / "compose.env")
    auto.up("--scale", "decode=1")
    wait_decode(auto, 1, timeout_s=READY_S)
    with Load(auto.base_url, expected, streams=16) as load:
        start = time.monotonic()
        wait_decode(auto, 2, timeout_s=300)
        grown = time.monotonic()
        ROWS.append(("actuator: load", "1 → 2 decode", load.tally(start, grown), grown - start))
        load.wait_requests(16)
    idle = time.monotonic()
    wait_decode(auto, 1, timeout_s=180)
    ROWS.append(("actuator: idle", "2 → 1 decode", None, time.monotonic() - idle))
    deadline = time.monotonic() + 120  # the stopped replica deregistered at once; it exits next
    while len(auto.containers("decode")) != 1:
        assert time.monotonic() < deadline, f"decode containers: {auto.containers('decode')}"
        time.sleep(1)
    tally = load.tally()
    assert tally.requests > 0 and tally.bad == 0, tally
