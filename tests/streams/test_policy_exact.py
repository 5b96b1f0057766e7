"""Every policy refusal at its edge, with its exact message (`_check` and
`load_policy` mutants survived tests that only checked that some ConfigError came)."""

from __future__ import annotations

import re

import pytest

from xidstream.schemas.errors import ConfigError
from xidstream.streams.policy import Policy, load_policy

D = 30 * 24 * 3600.0


def refused(settings, why):
    with pytest.raises(ConfigError) as e:
        load_policy(settings)
    assert str(e.value) == why, str(e.value)


# (settings at the edge: accepted, one step past it: refused with this message)
EDGES = [
    ({"suspect_window_s": D}, {"suspect_window_s": D + 1},
     "policy: suspect_window_s must be at most 2.592e+06 s (30 days), got 2.592e+06"),
    ({"wedged_xid43_lookback_s": 60.0}, {"wedged_xid43_lookback_s": 59.0},
     "policy: wedged_xid43_lookback_s must be >= pinned_seconds: a shorter lookback forgets the Xid 43 before the "
     "pinned evidence is complete, and no wedge is ever found"),
    ({"fleet_min_nodes": 1}, {"fleet_min_nodes": 0}, "policy: fleet_min_nodes must be >= 1"),
    ({"fleet_window_s": 0}, {"fleet_window_s": -1}, "policy: fleet_window_s must be >= 0"),
    ({"burst_seconds": 0}, {"burst_seconds": -0.5}, "policy: burst_seconds must be >= 0"),
    ({"resolve_after_s": 0}, {"resolve_after_s": -1}, "policy: resolve_after_s must be >= 0"),
    ({"pshc_cancel_s": 0}, {"pshc_cancel_s": -1}, "policy: pshc_cancel_s must be >= 0"),
    ({"workload_failure_lookback_s": 0}, {"workload_failure_lookback_s": -1},
     "policy: workload_failure_lookback_s must be >= 0"),
    ({"pinned_seconds": 10.0}, {"pinned_seconds": 9.9},
     "policy: pinned_seconds must be >= 10 (the guard's minimum span of pinned samples); below it a wedge could "
     "never be acted on"),
    ({"pinned_util_pct": 90.0}, {"pinned_util_pct": 89.9},
     "policy: pinned_util_pct must be in [90, 100]: below it an ordinary busy GPU would count as pinned"),
    ({"pinned_util_pct": 100.0}, {"pinned_util_pct": 100.1},
     "policy: pinned_util_pct must be in [90, 100]: below it an ordinary busy GPU would count as pinned"),
    ({"pinned_mem_fraction": 0.05}, {"pinned_mem_fraction": 0.051},
     "policy: pinned_mem_fraction must be in [0, 0.05]: above it a GPU with a job's memory resident would count as "
     "pinned"),
    ({"pinned_mem_fraction": 0.0}, {"pinned_mem_fraction": -0.01},
     "policy: pinned_mem_fraction must be in [0, 0.05]: above it a GPU with a job's memory resident would count as "
     "pinned"),
    ({"suspect_occurrences": 2}, {"suspect_occurrences": 1},
     "policy: suspect_occurrences must be >= 2: one occurrence is an application fault, never a reason to "
     "quarantine the GPU"),
    ({"suspect_distinct_pids": 2}, {"suspect_distinct_pids": 1},
     "policy: suspect_distinct_pids must be >= 2: one occurrence is an application fault, never a reason to "
     "quarantine the GPU"),
    ({"command_ttl_s": 0.001}, {"command_ttl_s": 0}, "policy: command_ttl_s must be > 0"),
    ({"max_clock_skew_s": 0}, {"max_clock_skew_s": -1}, "policy: max_clock_skew_s must be >= 0"),
    ({"reboot_confirm_s": 600}, {"reboot_confirm_s": 599},
     "policy: reboot_confirm_s must be >= 600: a GPU server's reboot (firmware, boot, driver, the collector's first "
     "inventory) takes minutes, and a shorter bound reports every reboot unseen"),
    ({"evidence_limit": 20}, {"evidence_limit": 19}, "policy: evidence_limit must be >= 20"),
]


@pytest.mark.parametrize("ok, bad, why", EDGES, ids=[next(iter(e[1])) + f"-{i}" for i, e in enumerate(EDGES)])
def test_each_bound_accepts_its_edge_and_refuses_one_step_past_it(ok, bad, why):
    p = load_policy(ok)
    for k, v in ok.items():
        assert getattr(p, k) == v
    refused(bad, why)


@pytest.mark.parametrize("settings, why", [
    ({"burst_seconds": float("nan")}, "policy: burst_seconds must be a finite number, got nan"),
    ({"fleet_fraction": float("inf")}, "policy: fleet_fraction must be a finite number, got inf"),
    ({"hardware_xids": [79, 13, 43]},
     "policy: hardware_xids lists application-class Xid 13, 43 (NVIDIA's catalog or the device plugin's list): an "
     "application's fault is never a reason for a node-level action"),
    ({"hardware_xids": [79, True]}, "policy: hardware_xids must be a list of integer Xid codes, got [79, True]"),
    ({"hardware_xids": [79, "48"]}, "policy: hardware_xids must be a list of integer Xid codes, got [79, '48']"),
    ({"hardware_xids": 79}, "policy: hardware_xids must be a list, got 79"),
    ({"evidence_limit": 20.5}, "policy: evidence_limit must be an integer, got 20.5"),
    ({"evidence_limit": True}, "policy: evidence_limit must be an integer, got True"),
    ({"evidence_limit": "30"}, "policy: evidence_limit must be an integer, got '30'"),
    ({"burst_seconds": True}, "policy: burst_seconds must be a number, got True"),
    ({"burst_seconds": "soon"}, "policy: burst_seconds must be a number, got 'soon'"),
])
def test_a_bad_value_is_refused_with_what_was_expected(settings, why):
    refused(settings, why)


def test_integers_and_sets_are_read_as_their_types():
    p = load_policy({"evidence_limit": 30.0, "hardware_xids": [79, 48, 79], "burst_seconds": 5})
    assert p.evidence_limit == 30 and type(p.evidence_limit) is int
    assert p.hardware_xids == frozenset({79, 48}) and type(p.burst_seconds) is float and p.burst_seconds == 5.0
    assert load_policy(None) == Policy() == load_policy({})


def test_unknown_and_retired_settings_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^policy: unknown setting\(s\) bogus, zzz; known: alert_cooldown_s, "):
        load_policy({"zzz": 1, "bogus": 2})
    with pytest.raises(ConfigError, match="^policy: app_class_xids is not a policy setting: which codes are "
                                          "application-class come"):
        load_policy({"app_class_xids": [13]})
    f = tmp_path / "p.yaml"
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(f))}: expected a mapping of settings$"):
        load_policy(f)
    f.write_text("evidence_limit: 19\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(f))}: evidence_limit must be >= 20$"):
        load_policy(f)
    f.write_text("")
    assert load_policy(f) == Policy()
    f.write_text("a: [\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(f))}: not valid YAML: "):
        load_policy(f)
    with pytest.raises(ConfigError, match=f"^cannot read {re.escape(str(tmp_path / 'none.yaml'))}: No such file"):
        load_policy(tmp_path / "none.yaml")


def test_the_fleet_fraction_is_in_zero_to_one_and_a_switch_is_true_or_false():
    assert load_policy({"fleet_fraction": 1.0}).fleet_fraction == 1.0
    for bad in (0, 1.01, 2.0):
        refused({"fleet_fraction": bad}, "policy: fleet_fraction must be in (0, 1]")
    assert load_policy({"dry_run": True}).dry_run is True
    refused({"dry_run": 1}, "policy: dry_run must be true or false, got 1")
    refused({"wedged_requires_workload_failure": "yes"},
            "policy: wedged_requires_workload_failure must be true or false, got 'yes'")


@pytest.mark.parametrize("bad", ["48", 48.0, True])
def test_a_policy_made_in_code_is_held_to_the_same_guard(bad):
    with pytest.raises(ConfigError) as e:
        Policy(hardware_xids=frozenset({79, bad}))
    assert str(e.value) == f"policy: hardware_xids must list integer Xid codes, got {bad!r}"


def test_a_reboot_must_be_seen_within_kureds_period_and_a_reboot_by_default():
    # kured looks at its sentinel once an hour by default (--period): a bound under that calls a
    # reboot kured was about to do unseen
    assert Policy().reboot_confirm_s == 5400.0 > 3600.0
