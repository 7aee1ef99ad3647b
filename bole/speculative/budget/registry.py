"""Every budget policy by name: the one place that knows which policies exist.

A new policy is one module with a :class:`~bole.speculative.budget.policy.PolicyBase` subclass
and one entry in :data:`POLICY_INFO`. Everything else asks the registry what a policy needs
(``policy_info(name).needs_profile``...) instead of comparing names.
"""

from __future__ import annotations

from dataclasses import dataclass

from bole.speculative.budget.calibrated import CalibratedPolicy
from bole.speculative.budget.fixed import FixedPolicy
from bole.speculative.budget.global_budget import GlobalPolicy
from bole.speculative.budget.goodput import GoodputPolicy
from bole.speculative.budget.policy import PolicyBase

__all__ = ["PolicyInfo", "POLICY_INFO", "POLICIES", "DEFAULT_POLICY", "policy_info",
           "make_policy"]


@dataclass(frozen=True)
class PolicyInfo:
    """A policy as the registry lists it.

    needs_profile:   it reads a calibration profile (measured by ``bole calibrate``).
    takes_eps:       the profile's tolerance ``budget_eps`` applies to it.
    host_timed:      it decides each round from this host's own timings, which tensor-parallel
                     ranks must not do apart.
    shared_budget:   it verifies ``SpecConfig.shared_budget`` draft nodes a round.
    """

    cls: type[PolicyBase]
    help: str
    needs_profile: bool = False
    takes_eps: bool = False
    host_timed: bool = False
    shared_budget: bool = False

    @property
    def name(self) -> str:
        return self.cls.name


#: every policy, in the order the command line lists them
POLICY_INFO: dict[str, PolicyInfo] = {info.name: info for info in (
    PolicyInfo(FixedPolicy, "every request its tree"),
    PolicyInfo(GlobalPolicy, "the batch's best --shared-budget draft nodes", shared_budget=True),
    PolicyInfo(CalibratedPolicy, "the budget of this GPU's calibration profile (bole calibrate)",
               needs_profile=True, takes_eps=True),
    PolicyInfo(GoodputPolicy, "the budget with the most expected tokens per ms, plain decoding "
               "while drafting delivers less than it", needs_profile=True, host_timed=True),
)}
POLICIES = tuple(POLICY_INFO)
DEFAULT_POLICY = FixedPolicy.name


def policy_info(name: str) -> PolicyInfo:
    """The registry's entry of ``name``; a ValueError naming the policies for any other."""
    if name not in POLICY_INFO:
        raise ValueError(f"budget_policy must be one of {POLICIES}, got {name!r}")
    return POLICY_INFO[name]


def make_policy(spec, T: int, profile=None) -> PolicyBase:
    """The policy of ``spec.budget_policy`` for trees of ``T`` node slots (``profile``: the
    calibration profile of the policies that need one)."""
    return policy_info(spec.budget_policy).cls(spec, T, profile)
