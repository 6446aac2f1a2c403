"""kvstore.tiering: the tier manager that places KV pages across GPU HBM, host DRAM
and NVMe (what it does and why, with its numbers: docs/tiering.md).

``TierManager.open(TierConfig(...))`` is the entry point. The manager (and with it
torch: the arena and the mover move tensors) is imported on first use of
``TierManager``, so the trace tools and the cost model load without torch;
``kvstore`` itself never imports this package.
"""

from typing import TYPE_CHECKING, Any

from kvstore.tiering.config import MODEL_PRESETS, ModelCost, TierConfig
from kvstore.tiering.cost import CostModel, PlanCost
from kvstore.tiering.pages import Tier
from kvstore.tiering.results import (
    LoadHandle,
    LoadPlan,
    LookupResult,
    LookupState,
    OfferResult,
    RequestContext,
    TierStats,
)

__all__ = [
    "MODEL_PRESETS",
    "CostModel",
    "LoadHandle",
    "LoadPlan",
    "LookupResult",
    "LookupState",
    "ModelCost",
    "OfferResult",
    "PlanCost",
    "RequestContext",
    "Tier",
    "TierConfig",
    "TierManager",
    "TierStats",
]

if TYPE_CHECKING:
    from kvstore.tiering.manager import TierManager


def __getattr__(name: str) -> Any:
    if name == "TierManager":
        from kvstore.tiering.manager import TierManager

        return TierManager
    raise AttributeError(f"module 'kvstore.tiering' has no attribute {name!r}")
