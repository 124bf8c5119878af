"""`dpserve.launch.policy`: the failure policy's table and the restart budget (pure, fast)."""

from __future__ import annotations

import pytest

from dpserve.launch.policy import FailureAction, RestartBudget, decide


class _FakeClock:
    """A clock the test moves by hand (fake: the budget's window without waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("policy", "can_isolate", "action"), [
    ("stop", True, FailureAction.STOP),
    ("stop", False, FailureAction.STOP),
    ("isolate", True, FailureAction.ISOLATE),
    ("isolate", False, FailureAction.RESTART),  # an API server, the coordinator
    ("restart", True, FailureAction.RESTART),
    ("restart", False, FailureAction.RESTART),
])
def test_policy_table_with_budget_left(policy: str, can_isolate: bool,
                                       action: FailureAction) -> None:
    decision = decide(policy, RestartBudget(1), 0, can_isolate=can_isolate)
    assert decision.action is action
    assert decision.budget_spent is False


@pytest.mark.parametrize(("can_isolate", "action"), [
    (True, FailureAction.ISOLATE),  # an engine: the rank stays out, the others serve on
    (False, FailureAction.STOP),  # an API server: the server stops
])
def test_spent_budget_isolates_or_stops(can_isolate: bool, action: FailureAction) -> None:
    budget = RestartBudget(2)
    for _ in range(2):
        assert decide("restart", budget, 7, can_isolate=can_isolate).action \
            is FailureAction.RESTART
    decision = decide("restart", budget, 7, can_isolate=can_isolate)
    assert decision.action is action
    assert decision.budget_spent is True


def test_budget_is_per_key() -> None:
    budget = RestartBudget(1)
    assert decide("restart", budget, 0, can_isolate=True).action is FailureAction.RESTART
    assert decide("restart", budget, 0, can_isolate=True).action is FailureAction.ISOLATE
    assert decide("restart", budget, 1, can_isolate=True).action is FailureAction.RESTART


def test_no_budget_means_no_limit() -> None:
    for _ in range(50):
        assert decide("restart", None, -1, can_isolate=False).action is FailureAction.RESTART
    assert decide("stop", None, -1, can_isolate=False).action is FailureAction.STOP


def test_stop_and_isolate_take_nothing_from_the_budget() -> None:
    budget = RestartBudget(1)
    decide("stop", budget, 3, can_isolate=True)
    decide("isolate", budget, 3, can_isolate=True)
    assert budget.used(3) == 0
    assert budget.left(3)


def test_zero_restarts_allowed() -> None:
    decision = decide("restart", RestartBudget(0), 0, can_isolate=True)
    assert decision.action is FailureAction.ISOLATE
    assert decision.budget_spent is True


def test_restarts_leave_the_window() -> None:
    clock = _FakeClock()
    budget = RestartBudget(2, window_s=600.0, clock=clock)
    assert budget.take(0) and budget.take(0)
    assert not budget.take(0)
    clock.now += 600.0  # exactly the window: still inside
    assert budget.used(0) == 2
    clock.now += 0.5  # the first two leave the window together
    assert budget.used(0) == 0
    assert budget.take(0)
    assert budget.used(0) == 1


def test_forget_gives_a_fresh_record() -> None:
    budget = RestartBudget(1)
    assert budget.take(5)
    assert not budget.left(5)
    budget.forget(5)
    assert budget.left(5)
    budget.forget(99)  # unknown keys are fine
