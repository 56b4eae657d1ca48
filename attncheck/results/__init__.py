"""What attncheck returns: plain dataclasses of numbers and names, free of torch.

``numerics`` fills them, ``findings`` reads them, ``report`` formats them. The
JSON reports are these dataclasses as they are (fields starting with ``_`` and
the few marked "Not in the JSON report" are left out).

One module per command: ``common`` (what every command shares: roles, a dtype's
limits, a finding), ``backward`` (a cell's gradients), ``run`` (one tensor's
diagnosis: census, cells, audits, settings grids), ``model`` (many calls: call
reports, the model report, and ``RunResult``), ``sweep``, ``check`` and ``watch``.
Every public name is re-exported here: ``from attncheck.results import Cell``.
"""

from __future__ import annotations

from attncheck.results.activations import (
    CallActivations,
    ChannelPeak,
    HeadActivations,
    KeyShares,
    LargeActivation,
)
from attncheck.results.backward import (
    GRAD_CAUSES,
    REAL_BOUND_TOLERANCE,
    CellBackward,
    GradStats,
)
from attncheck.results.check import (
    BUDGET_NAMES,
    COUNT_BUDGETS,
    ERROR_BUDGETS,
    LOWER_BUDGETS,
    OUTPUT_BUDGETS,
    PROB_COUNT_BUDGETS,
    RELATIVE_BUDGET,
    RELATIVE_BUDGETS,
    Budget,
    BudgetCheck,
    CaseResult,
    CheckResult,
)
from attncheck.results.common import (
    ASKED,
    FLASH_RULE_FACTOR,
    MODEL,
    OUT_CAUSES,
    ROLES,
    UNEXPLAINED,
    WHAT_IF,
    DtypeLimits,
    Finding,
    flash_rule_bound,
)
from attncheck.results.lowsum import CallSums, CaptureSums, LayerSums, LowSumStats, SumOverflow
from attncheck.results.model import (
    CallInfo,
    CallReport,
    DecodeRun,
    HeadMark,
    HeadStat,
    KernelCall,
    KernelVerdict,
    ModelLine,
    ModelReport,
    Outlier,
    RankSummary,
    RunResult,
    WhatIfAnswer,
)
from attncheck.results.run import (
    AttentionAudit,
    Cell,
    CellLimit,
    Census,
    Distribution,
    DtypeAudit,
    DtypeHeadroom,
    SettingChoice,
    SettingPoint,
    SoftCap,
    TensorDiagnosis,
)
from attncheck.results.sweep import (
    PresetCheck,
    PresetGrid,
    PresetResult,
    PresetRow,
    SweepCell,
    SweepOutput,
    SweepPoint,
    SweepResult,
)
from attncheck.results.watch import (
    WatchAlert,
    WatchReport,
    WatchSeries,
)

__all__ = [
    "CallActivations",
    "ChannelPeak",
    "HeadActivations",
    "KeyShares",
    "LargeActivation",
    "ASKED",
    "FLASH_RULE_FACTOR",
    "MODEL",
    "OUT_CAUSES",
    "ROLES",
    "UNEXPLAINED",
    "WHAT_IF",
    "DtypeLimits",
    "Finding",
    "flash_rule_bound",
    "GRAD_CAUSES",
    "REAL_BOUND_TOLERANCE",
    "CellBackward",
    "GradStats",
    "AttentionAudit",
    "Cell",
    "CellLimit",
    "Census",
    "Distribution",
    "DtypeAudit",
    "DtypeHeadroom",
    "SettingChoice",
    "SettingPoint",
    "SoftCap",
    "TensorDiagnosis",
    "CallSums",
    "CaptureSums",
    "LayerSums",
    "LowSumStats",
    "SumOverflow",
    "CallInfo",
    "CallReport",
    "HeadMark",
    "HeadStat",
    "KernelCall",
    "KernelVerdict",
    "DecodeRun",
    "ModelLine",
    "ModelReport",
    "Outlier",
    "RankSummary",
    "RunResult",
    "WhatIfAnswer",
    "PresetCheck",
    "PresetGrid",
    "PresetResult",
    "PresetRow",
    "SweepCell",
    "SweepOutput",
    "SweepPoint",
    "SweepResult",
    "BUDGET_NAMES",
    "COUNT_BUDGETS",
    "ERROR_BUDGETS",
    "LOWER_BUDGETS",
    "OUTPUT_BUDGETS",
    "PROB_COUNT_BUDGETS",
    "RELATIVE_BUDGET",
    "RELATIVE_BUDGETS",
    "Budget",
    "BudgetCheck",
    "CaseResult",
    "CheckResult",
    "WatchAlert",
    "WatchReport",
    "WatchSeries",
]
