"""``service.llm_budget``: LLM endpoint calls per client address."""

import pytest

from paraseek.service.llm_budget import ClientBudget

pytestmark = pytest.mark.quick


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_client_spends_a_minutes_worth_then_waits_for_the_refill():
    clock = Clock()
    budget = ClientBudget(per_minute=60, clock=clock)
    assert budget.take("a", 40) is None and budget.take("a", 20) is None
    assert budget.take("a", 30) == pytest.approx(30.0)  # 30 calls at one a second: nothing spent
    assert budget.take("b", 60) is None  # another address has its own
    clock.now = 10.0
    assert budget.take("a", 10) is None and budget.take("a", 1) == pytest.approx(1.0)
    clock.now = 1000.0
    assert budget.take("a", 60) is None and budget.take("a", 1) is not None  # a minute's worth at most
