"""``serve`` and ``GatewayConfig`` refuse unusable settings at start-up, naming them."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from rollout_gateway.cli import build_parser, main, serve_config
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.server.http.auth import load_admin_token

UP = "http://127.0.0.1:8001/v1"
TOKEN = "serve-admin-token-0123456789"


@pytest.mark.parametrize(
    "option,value",
    [
        ("--max-body-bytes", "0"),
        ("--max-body-bytes", "-5"),
        ("--max-concurrent-parses", "0"),
        ("--max-exit-streams", "0"),
        ("--rollout-ttl", "0"),
        ("--rollout-ttl", "nan"),
        ("--max-rollouts", "-1"),
        ("--upstream-timeout", "inf"),
        ("--header-timeout", "0"),
        ("--max-connections", "0"),
        ("--max-turns", "x"),
        ("--upstream", "not a url"),
        ("--upstream", "ftp://host/v1"),
        ("--upstream", "http://host:99999/v1"),
        ("--upstream-client", "requests"),
        ("--loop", "trio"),
        ("--port", "70000"),
        ("--port", "-1"),
        ("--port", "http"),
        ("--log-level", "loud"),
    ],
)
def test_invalid_option_is_refused_naming_it(option: str, value: str, capsys) -> None:
    args = ["serve", "--upstream", UP, option, value]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(args)
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--admin-token", "--upstream-api-key"])
def test_secrets_are_never_command_line_arguments(option: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--upstream", UP, option, "secret"])
    assert "not accepted on the command line" in capsys.readouterr().err


def test_serve_refuses_to_start_without_a_token(monkeypatch, capsys) -> None:
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    assert main(["serve", "--upstream", UP]) == 2
    assert "no admin token" in capsys.readouterr().err


def test_open_mode_is_explicit_and_loopback_only(monkeypatch) -> None:
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    args = build_parser().parse_args(["serve", "--upstream", UP, "--open-control-plane"])
    assert serve_config(args).admin_token is None
    public = build_parser().parse_args(
        ["serve", "--upstream", UP, "--open-control-plane", "--host", "0.0.0.0"]
    )
    with pytest.raises(ValueError, match="--open-control-plane"):
        serve_config(public)


async def test_open_gateway_app_refuses_a_public_bind() -> None:
    app = create_app(GatewayConfig(upstreams=[UP], open_control_plane=True))
    with pytest.raises(ValueError, match="loopback"):
        async with running_server(app, host="0.0.0.0"):
            pass


def test_token_from_env_or_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    args = build_parser().parse_args(["serve", "--upstream", UP])
    config = serve_config(args)
    assert config.admin_token == TOKEN and config.require_rollout_keys
    path = tmp_path / "token"
    path.write_text("file-token-0123456789abcdef\n")
    assert load_admin_token(path, environ={}) == "file-token-0123456789abcdef"
    with pytest.raises(ValueError, match="at least"):
        load_admin_token(environ={"ROLLOUT_GATEWAY_ADMIN_TOKEN": "short"})
    with pytest.raises(ValueError, match="cannot read"):
        load_admin_token(tmp_path / "missing", environ={})


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"upstreams": []}, "upstreams"),
        ({"upstreams": ["localhost:8000"]}, "upstreams"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"rollout_ttl_s": -1.0}, "rollout_ttl_s"),
        ({"upstream_timeout_s": float("nan")}, "upstream_timeout_s"),
        ({"max_rollouts": 0}, "max_rollouts"),
        ({"admin_token": None}, "admin_token"),
        ({"admin_token": "  "}, "admin_token"),
        # A bool or a string is not a number, nor a float an integer (JSON or YAML
        # config files give such values); a flag is a bool.
        ({"max_rollouts": True}, "max_rollouts"),
        ({"max_body_bytes": "1024"}, "max_body_bytes"),
        ({"max_pending_turns": 2.5}, "max_pending_turns"),
        ({"rollout_ttl_s": "60"}, "rollout_ttl_s"),
        ({"default_max_context_tokens": True}, "default_max_context_tokens"),
        ({"require_rollout_keys": "false"}, "require_rollout_keys"),
        ({"open_control_plane": 1}, "open_control_plane"),
        ({"admin_token": 12345678901234567890}, "admin_token"),
        ({"upstream_mode": None}, "upstream_mode"),
    ],
)
def test_config_validation_names_the_field(fields: dict, name: str) -> None:
    kwargs = {"upstreams": [UP], "admin_token": TOKEN, **fields}
    with pytest.raises(ValueError, match=name):
        GatewayConfig(**kwargs)


def test_token_in_options_are_checked_naming_them(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    parse = build_parser().parse_args
    with pytest.raises(SystemExit):
        parse(["serve", "--upstream", UP, "--upstream-mode", "tokens"])
    assert "--upstream-mode" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tokenizer: only with --upstream-mode token-in"):
        serve_config(parse(["serve", "--upstream", UP, "--tokenizer", str(tmp_path)]))
    # No --tokenizer and an upstream that does not answer /models: nothing to default to.
    dead = "http://127.0.0.1:9/v1"
    with pytest.raises(ValueError, match="--tokenizer: required"):
        serve_config(parse(["serve", "--upstream", dead, "--upstream-mode", "token-in"]))
    config = serve_config(
        parse(["serve", "--upstream", UP, "--upstream-mode", "token-in", "--tokenizer", "/m"])
    )
    assert (config.upstream_mode, config.tokenizer, config.renderer) == ("token-in", "/m", "auto")
    # Start-up fails, naming the option: renderers missing ([tito]), or no tokenizer there.
    args = ["serve", "--upstream", UP, "--upstream-mode", "token-in", "--tokenizer", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--upstream-mode token-in" in err or "--tokenizer" in err


async def test_tokenizer_defaults_to_the_model_directory_the_upstream_serves(tmp_path) -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from rollout_gateway.cli import served_model_path

    async def models(request):
        cards = [{"id": "a", "root": "org/remote-name"}, {"id": "m", "root": str(tmp_path)}]
        return JSONResponse({"object": "list", "data": cards})

    app = Starlette(routes=[Route("/v1/models", models)])
    async with running_server(app) as root:
        found = await asyncio.to_thread(served_model_path, f"{root}/v1")
    assert found == str(tmp_path)


def test_the_loop_option_reaches_the_server(monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    args = build_parser().parse_args(["serve", "--upstream", UP, "--loop", "asyncio"])
    assert args.loop == "asyncio"
    assert build_parser().parse_args(["serve", "--upstream", UP]).loop == "auto"


@pytest.mark.parametrize(
    "option,value",
    [("--port", "70000"), ("--port", "0"), ("--latency-ms", "-5"), ("--latency-ms", "nan")],
)
def test_scripted_model_refuses_invalid_options_naming_them(option, value, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["scripted-model", option, value])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_log_level_is_case_insensitive() -> None:
    args = build_parser().parse_args(["serve", "--upstream", UP, "--log-level", "DEBUG"])
    assert (args.log_level, args.port) == ("debug", 8000)


def test_serve_defaults_are_the_gateway_config_defaults(monkeypatch) -> None:
    # The limits page's table (docs/limits.md) gives one default per option; serve and GatewayConfig
    # (in code) must not drift apart.
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    monkeypatch.delenv("ROLLOUT_GATEWAY_UPSTREAM_API_KEY", raising=False)
    from_serve = serve_config(build_parser().parse_args(["serve", "--upstream", UP]))
    in_code = GatewayConfig(upstreams=[UP], admin_token=TOKEN)
    assert from_serve == in_code


# -- --redis (several gateways on one Redis, docs/state.md) ---------------------------------


def test_redis_options_reach_the_config(monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    args = build_parser().parse_args(
        ["serve", "--upstream", UP, "--redis", "redis://:pw@10.0.0.5:6380/2",
         "--redis-prefix", "train-7:", "--redis-lease", "3"]
    )  # fmt: skip
    config = serve_config(args)
    assert (config.redis_url, config.redis_prefix, config.redis_lease_s) == (
        "redis://:pw@10.0.0.5:6380/2", "train-7:", 3.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--redis", "http://:secret@host:6379"], "--redis: a redis://, rediss:// or unix:// URL"),
        (["--redis", "redis://h", "--redis-lease", "0"], "--redis-lease"),
        (["--redis-prefix", "train-7:"], "--redis-prefix: only with --redis"),
        (["--redis-lease", "3"], "--redis-lease: only with --redis"),
    ],
)
def test_unusable_redis_options_are_refused_naming_them(
    argv: list[str], message: str, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    with contextlib.suppress(SystemExit):
        assert main(["serve", "--upstream", UP, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "secret" not in err


def test_a_redis_url_with_a_state_dir_is_refused() -> None:
    with pytest.raises(ValueError, match="redis_url and state_dir: choose one"):
        GatewayConfig(upstreams=[UP], admin_token=TOKEN, redis_url="redis://h", state_dir="/x")


def test_serve_exits_with_one_line_when_redis_is_unreachable(monkeypatch, capsys) -> None:
    from rollout_gateway.local_cluster import free_port

    pytest.importorskip("redis")
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    port = free_port()  # nothing listens there
    assert main(["serve", "--upstream", UP, "--redis", f"redis://127.0.0.1:{port}/0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollout-gateway serve: error: --redis: redis at 127.0.0.1:")
    assert str(port) in err and "\n" not in err


def test_serve_refuses_redis_holding_another_versions_state(monkeypatch, capsys) -> None:
    redis = pytest.importorskip("redis")
    from .state.redis_fixtures import shared_redis_url

    url = shared_redis_url()
    redis.Redis.from_url(url).hset("other-version:meta", mapping={"layout": 99, "secret": "ab"})
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    argv = ["serve", "--upstream", UP, "--redis", url, "--redis-prefix", "other-version:"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--redis: Redis at 127.0.0.1:" in err and "layout 99" in err and "\n" not in err


def test_serve_help_describes_the_redis_options(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--redis URL" in out and "load balancer" in out and "status 2" in out
    assert "--redis-prefix PREFIX" in out and "--redis-lease SECONDS" in out


# -- options that each look valid but cannot hold together (issue 26) --------------------


def _serve(argv: list[str], monkeypatch, env: dict[str, str] | None = None) -> int:
    """``main(["serve", ...])`` as far as it gets before serving (a gateway that would
    start serves nothing here: its ``serve`` is replaced)."""
    import rollout_gateway.server as server
    from rollout_gateway.server.http import fds
    from rollout_gateway.server.ops import gc_tuning

    # What only a serving process does to itself stays out of the test process.
    monkeypatch.setattr(gc_tuning, "tune_for_serving", lambda: None)
    monkeypatch.setattr(fds, "raise_fd_limit", fds.fd_limit)
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    monkeypatch.delenv("ROLLOUT_GATEWAY_UPSTREAM_API_KEY", raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    started: list[object] = []
    monkeypatch.setattr(server, "serve", lambda app, **kwargs: started.append(app))
    code = main(["serve", *argv])
    assert code != 0 or started, "serve returned 0 without serving"
    return code


@pytest.mark.parametrize(
    "argv,env,named",
    [
        # The case: every turn was a 500 (one Authorization header, two sources).
        (
            ["--upstream", "http://user:secret@127.0.0.1:8001/v1"],
            {"ROLLOUT_GATEWAY_UPSTREAM_API_KEY": "sk-upstream"},
            "$ROLLOUT_GATEWAY_UPSTREAM_API_KEY",
        ),
        (["--upstream", UP, "--renderer", "qwen3"], {}, "--renderer"),
        (["--upstream", UP, "--upstream", UP + "/"], {}, "--upstream"),
        (["--upstream", UP, "--max-body-cost", "1000"], {}, "--max-body-cost"),
        (
            ["--upstream", UP, "--body-memory", str(300 * 1024 * 1024)],
            {},
            "--body-memory",
        ),
        (
            ["--upstream", UP],
            {"ROLLOUT_GATEWAY_UPSTREAM_API_KEY": "two words"},
            "ROLLOUT_GATEWAY_UPSTREAM_API_KEY",
        ),
        (["--upstream", "http://localhost:8000/v1"], {}, "own address"),
        (["--upstream", "http://127.0.0.1:9000/v1", "--port", "9000"], {}, "own address"),
    ],
    ids=[
        "credentials-and-api-key", "renderer-without-token-in", "same-upstream-twice",
        "cost-below-body-size", "body-memory-too-small", "api-key-not-a-header",
        "upstream-is-the-gateway", "upstream-is-the-gateway-on-its-port",
    ],
)  # fmt: skip
def test_contradictory_options_are_refused_at_start_in_one_line(
    argv: list[str], env: dict[str, str], named: str, monkeypatch, capsys
) -> None:
    assert _serve(argv, monkeypatch, env) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rollout-gateway serve: error:")
    assert named in err
    assert "secret" not in err  # an upstream's credentials never reach the output


def test_the_credentials_contradiction_holds_for_library_users_too() -> None:
    with pytest.raises(ValueError, match="credentials"):
        GatewayConfig(
            upstreams=["http://user:secret@upstream/v1"],
            admin_token=TOKEN,
            upstream_api_key="sk-upstream",
        )
    # Each alone is fine.
    GatewayConfig(upstreams=["http://user:secret@upstream/v1"], admin_token=TOKEN)
    GatewayConfig(upstreams=[UP], admin_token=TOKEN, upstream_api_key="sk-upstream")


@pytest.mark.parametrize(
    "option,value",
    [("--rollout-parse-share", "0"), ("--rollout-parse-share", "1.5"), ("--max-body-cost", "0"),
     ("--body-memory", "-1"), ("--max-model-len", "0")],
)  # fmt: skip
def test_new_bounds_refuse_invalid_values_naming_them(option: str, value: str, capsys) -> None:
    command = "scripted-model" if option == "--max-model-len" else "serve"
    argv = [command, option, value] if command == "scripted-model" else [
        "serve", "--upstream", UP, option, value
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_consistent_new_bounds_start(monkeypatch) -> None:
    argv = [
        "--upstream", UP, "--max-body-bytes", str(4 * 1024 * 1024), "--max-body-cost",
        str(64 * 1024 * 1024), "--body-memory", str(256 * 1024 * 1024),
        "--rollout-parse-share", "1", "--max-connections", "64",
    ]  # fmt: skip
    assert _serve(argv, monkeypatch) == 0
