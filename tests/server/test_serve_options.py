"""``serve`` and ``GatewayConfig`` refuse unusable settings at start-up, naming them."""

from __future__ import annotations

import asyncio
import contextlib
import re

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
        GatewayConfig.from_fields(**kwargs)


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
    assert (config.upstream.upstream_mode, config.upstream.tokenizer, config.upstream.renderer) == (
        "token-in",
        "/m",
        "auto",
    )
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
    assert (config.state.redis_url, config.state.redis_prefix, config.state.redis_lease_s) == (
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
    with pytest.raises(
        ValueError, match=r"redis_url and state_dir \(--redis and --state-dir\): choose"
    ):
        GatewayConfig.from_fields(
            upstreams=[UP], admin_token=TOKEN, redis_url="redis://h", state_dir="/x"
        )


def test_serve_exits_with_one_line_when_redis_is_unreachable(monkeypatch, capsys) -> None:
    from support.local_cluster import free_port

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
        GatewayConfig.from_fields(
            upstreams=["http://user:secret@upstream/v1"],
            admin_token=TOKEN,
            upstream_api_key="sk-upstream",
        )
    # Each alone is fine.
    GatewayConfig(upstreams=["http://user:secret@upstream/v1"], admin_token=TOKEN)
    GatewayConfig.from_fields(upstreams=[UP], admin_token=TOKEN, upstream_api_key="sk-upstream")


@pytest.mark.parametrize(
    "option,value",
    [("--rollout-parse-share", "0"), ("--rollout-parse-share", "1.5"), ("--max-body-cost", "0"),
     ("--body-memory", "-1"), ("--max-model-len", "-1")],
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
    from support.local_cluster import free_port

    argv = [
        "--upstream", UP, "--max-body-bytes", str(4 * 1024 * 1024), "--max-body-cost",
        str(64 * 1024 * 1024), "--body-memory", str(256 * 1024 * 1024),
        "--rollout-parse-share", "1", "--max-connections", "64",
        "--port", str(free_port()),  # serve checks nothing else listens there
    ]  # fmt: skip
    assert _serve(argv, monkeypatch) == 0


# -- each option declared once (issue 32 point 2) ------------------------------------------


@pytest.mark.parametrize(
    "group,fields,flag",
    [
        ("intake", {"max_body_bytes": 0}, "--max-body-bytes"),
        ("limits", {"max_messages": -1}, "--max-messages"),
        ("limits", {"retry_dedupe_window_s": float("inf")}, "--retry-window"),
        ("connections", {"header_timeout_s": 0.0}, "--header-timeout"),
        ("registry", {"max_rollouts": True}, "--max-rollouts"),
        ("upstream", {"tokenizer": "/m"}, "--tokenizer"),
        ("upstream", {"upstream_api_key": "two words"}, "$ROLLOUT_GATEWAY_UPSTREAM_API_KEY"),
        ("state", {"redis_url": "http://h"}, "--redis"),
        ("state", {"state_sync": "always"}, "--state-sync"),
    ],
)
def test_a_config_error_names_its_field_and_flag(group: str, fields: dict, flag: str) -> None:
    from rollout_gateway.options import ConfigError

    with pytest.raises(ConfigError) as raised:
        GatewayConfig.from_fields(upstreams=[UP], admin_token=TOKEN, **fields)
    (name,) = fields
    assert f"{name} ({flag}): " in str(raised.value)
    assert raised.value.command_line.startswith(f"{flag}: ")
    # The same rule, from its value object in code.
    kind = type(getattr(GatewayConfig(upstreams=[UP], admin_token=TOKEN), group))
    with pytest.raises(ConfigError, match=re.escape(f"({flag})")):
        GatewayConfig(upstreams=[UP], admin_token=TOKEN, **{group: kind(**fields)})


@pytest.mark.parametrize(
    "option,value,field",
    [
        ("--max-body-bytes", "0", "max_body_bytes"),
        ("--retry-window", "nan", "retry_dedupe_window_s"),
        ("--rollout-parse-share", "2", "rollout_parse_share"),
        ("--max-connections", "x", "max_connections"),
    ],
)
def test_the_command_line_and_the_config_refuse_the_same_values(
    option: str, value: str, field: str, capsys
) -> None:
    # One check per option: the flag's type and the field's check are the same Bound.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--upstream", UP, option, value])
    said = capsys.readouterr().err
    number = float(value) if value != "x" else value
    with pytest.raises(ValueError, match=re.escape(option)):
        GatewayConfig.from_fields(upstreams=[UP], admin_token=TOKEN, **{field: number})
    assert option in said


def test_every_serve_flag_sets_the_field_that_declares_it(monkeypatch) -> None:
    """Each declared flag, typed with a non-default value, lands on its field."""
    from rollout_gateway.options import options_of
    from rollout_gateway.server import config as settings

    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    values = {"max_body_bytes": "1000", "max_body_cost": "100000", "body_memory": "10000000"}
    groups = {
        "limits": settings.RolloutLimits,
        "connections": settings.ConnectionSettings,
        "registry": settings.RegistrySettings,
        "intake": settings.IntakeLimits,
    }
    for group, kind in groups.items():
        for f, declared in options_of(kind):
            if declared.flag is None or declared.bound is None:
                continue
            text = values.get(f.name, "0.5" if declared.bound.kind is float else "7")
            args = build_parser().parse_args(
                ["serve", "--upstream", UP, declared.flag, text,
                 *(a for k, v in values.items() if k != f.name for a in _flag_of(k, v))]
            )  # fmt: skip
            config = serve_config(args)
            assert getattr(getattr(config, group), f.name) == declared.bound.parse(text), f.name


def _flag_of(name: str, value: str) -> list[str]:
    from rollout_gateway.options import source_of
    from rollout_gateway.server.config import IntakeLimits

    return [str(source_of(IntakeLimits, name)), value]


def test_options_that_need_another_one_are_refused_naming_both(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    assert main(["serve", "--upstream", UP, "--state-sync", "full"]) == 2
    assert "--state-sync: only with --state-dir" in capsys.readouterr().err
