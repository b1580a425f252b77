"""How often an agent's sandbox is asked (rollout_gateway.polling): the adaptive interval,
and ExitPollPlan's decisions, event by event, without an event loop or a clock."""

from __future__ import annotations

import pytest

from rollout_gateway.polling import ExitPollPlan, PollPolicy, PollStep

POLICY = PollPolicy(
    min_interval=0.05,
    max_interval=1.0,
    elapsed_fraction=0.05,
    safety_interval=10.0,
    start_grace=1.0,
    max_consecutive_read_errors=3,
)
STARTED = {"rollout_id": "r", "exit_code": None, "seq": 1, "started": True}
EXITED = {"rollout_id": "r", "exit_code": 0, "seq": 2}
REFUSED = {"rollout_id": "r", "exit_code": None, "seq": 3, "refused": "max_turns_reached"}


def wait(seconds: float) -> PollStep:
    return PollStep("wait", seconds)


def plan(*, watching: bool = True, expect: bool = True) -> ExitPollPlan:
    return ExitPollPlan(POLICY, started=100.0, watching=watching, expect=expect)


def test_the_interval_is_a_fraction_of_the_time_run_within_its_bounds() -> None:
    assert POLICY.interval(0.0) == 0.05
    assert POLICY.interval(4.0) == pytest.approx(0.2)
    assert POLICY.interval(3600.0) == 1.0


def test_without_an_exit_channel_the_sandbox_is_polled_adaptively() -> None:
    p = plan(watching=False, expect=False)
    assert p.first() == wait(0.05)
    assert p.heard(None, now=100.05, supported=None, refused=False).action == "probe"
    assert p.probed(None, now=110.0, supported=None) == wait(pytest.approx(0.5))
    assert p.heard(None, now=110.5, supported=None, refused=False).action == "probe"


def test_a_heard_start_means_only_the_safety_poll() -> None:
    p = plan()
    assert p.first() == wait(0.05)
    assert p.heard(STARTED, now=100.05, supported=True, refused=False) == wait(10.0)
    # The safety poll's wait elapsed: ask the sandbox, then wait the safety interval again.
    assert p.heard(None, now=110.05, supported=True, refused=False).action == "probe"
    assert p.probed(None, now=110.1, supported=True) == wait(10.0)


def test_until_the_start_is_heard_the_wait_runs_to_the_end_of_the_grace() -> None:
    p = plan()
    p.first()
    assert p.heard(None, now=100.3, supported=None, refused=False) == wait(pytest.approx(0.7))
    # No start report within the grace (an image without an HTTP client): poll.
    assert p.heard(None, now=101.0, supported=None, refused=False).action == "probe"
    assert p.probed(None, now=101.0, supported=None) == wait(0.05)


def test_a_gateway_without_reports_is_not_waited_for() -> None:
    p = plan()
    p.first()
    assert p.heard(None, now=100.05, supported=False, refused=False).action == "probe"
    assert p.probed(None, now=100.1, supported=False) == wait(0.05)


def test_an_exit_report_is_confirmed_and_one_the_sandbox_denies_ends_the_trust() -> None:
    p = plan()
    p.heard(STARTED, now=100.05, supported=True, refused=False)
    assert p.heard(EXITED, now=105.0, supported=True, refused=False).action == "probe"
    # The sandbox says the agent still runs: no report is trusted from now on.
    assert p.probed(EXITED, now=105.0, supported=True) == wait(0.25)
    assert p.expect is False


def test_a_refusal_stops_the_agent_once() -> None:
    p = plan()
    p.heard(STARTED, now=100.05, supported=True, refused=False)
    assert p.heard(REFUSED, now=102.0, supported=True, refused=False).action == "stop"
    assert p.expect is False
    # The refusal's own report does not make a running agent's reports untrusted twice,
    # and the probe after the stop polls adaptively.
    assert p.probed(REFUSED, now=102.0, supported=True) == wait(pytest.approx(0.1))
    # Reported again (a later report keeps it): acted on already, not stopped again.
    assert p.heard(REFUSED, now=102.1, supported=True, refused=True).action == "wait"


def test_transient_probe_failures_are_tolerated_up_to_the_limit_in_a_row() -> None:
    p = plan(watching=False, expect=False)
    assert p.probe_failed(None, now=100.0, supported=None) == wait(0.05)
    assert p.probe_failed(None, now=100.0, supported=None) == wait(0.05)
    assert p.probed(None, now=100.0, supported=None) == wait(0.05)  # an answer resets
    assert p.probe_failed(None, now=100.0, supported=None) is not None
    assert p.probe_failed(None, now=100.0, supported=None) is not None
    assert p.probe_failed(None, now=100.0, supported=None) is None
    assert p.read_errors == 3
