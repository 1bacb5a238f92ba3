"""The base-score registry checks its entries when they are built, and the policy grammar is parsed and built in
`caote.policies` alone."""

from __future__ import annotations

import dataclasses

import pytest

from caote.bases import BASE_SCORES, SCHEDULES, About, BaseScore, register
from caote.benchmark.config import BASELINE_POLICY, BLOCK_POLICY, DEFAULT_POLICIES, LEARNED_POLICY
from caote.defaults import PAPER_GROUP
from caote.history import AttentionSum, RecentRows
from caote.policies import POLICY_GROUPS, expand_policies, parse_policy, policy_name, policy_names
from caote.strategies import STRATEGIES

GOOD = BaseScore(name="mine", score=lambda x: x.keys, about=About("a test base", "-"))


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"reads": ("keys", "queries")}, "reads"),
        ({"reads": "keys"}, "reads"),  # a string, not a tuple: ('k', 'e', ...)
        ({"schedule": "later"}, "schedule"),
        ({"draft_tokens": 4}, "draft_tokens"),  # a draft with the immediate schedule
        ({"schedule": "lookahead", "memory": RecentRows(8)}, "draft_tokens"),  # a look-ahead without a draft
        ({"recent_window": 0}, "recent_window"),
        ({"recent_window": 1.5}, "recent_window"),
        ({"recent_window": True}, "recent_window"),
        ({"memory": RecentRows}, "memory"),  # the class, not a memory
        ({"per_query_head": True}, "per_query_head"),  # attention rows with no memory to hold them
        ({"distribution": True, "memory": RecentRows(1)}, "distribution"),
        ({"rank_only": True, "signed": True}, "rank_only"),
        ({"kept_by_recency": lambda *a: None}, "kept_by_recency"),
        ({"name": "my+base"}, "name"),
        ({"name": "Mine"}, "name"),
        ({"name": "full"}, "name"),
    ],
)
def test_a_nonsensical_base_fails_when_built_naming_the_base_and_the_field(fields, field):
    with pytest.raises(ValueError) as error:
        dataclasses.replace(GOOD, **fields)
    message = str(error.value)
    assert "\n" not in message and field in message, message
    assert message.startswith(f"base {fields.get('name', 'mine')!r}: "), message


def test_every_registered_base_passes_its_checks_and_a_name_registers_once():
    for base in BASE_SCORES.values():
        assert dataclasses.replace(base) == base
    assert dataclasses.replace(GOOD, per_query_head=True, memory=AttentionSum(), recent_window=0.5).per_query_head
    assert list(register(GOOD, BASE_SCORES["h2o"])) == ["mine", "h2o"]
    with pytest.raises(ValueError, match="^base 'h2o': name registered twice"):
        register(BASE_SCORES["h2o"], GOOD, BASE_SCORES["h2o"])


def test_the_schedules_are_the_strategies():
    assert set(SCHEDULES) == set(STRATEGIES)
    assert {base.schedule for base in BASE_SCORES.values()} <= set(SCHEDULES)


def test_names_are_built_and_taken_apart_by_the_policies_alone():
    for name in policy_names(hindsight=True)[1:]:
        policy = parse_policy(name)
        assert policy_name(policy.base_name, policy.transform, policy.gqa) == name
    policy = parse_policy("Tova+CAOTE/mean")
    assert (policy.name, policy.base_name, policy.transform, policy.gqa) == ("tova+caote/mean", "tova", "caote", "mean")
    assert parse_policy("full").base_name is None


def test_the_paper_group_is_written_once():
    assert POLICY_GROUPS["paper"] == list(PAPER_GROUP) == expand_policies("paper")
    paper = tuple(name for name in PAPER_GROUP if parse_policy(name).evicts)
    assert DEFAULT_POLICIES == (*paper, LEARNED_POLICY, BLOCK_POLICY)
    assert DEFAULT_POLICIES[0] == BASELINE_POLICY
