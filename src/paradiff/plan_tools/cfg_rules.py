"""The CFG section's table in docs/pipelines.md, generated from plans/pipelines.py (tests/test_cfg.py checks it):

    python -c "from paradiff.plan_tools.cfg_rules import cfg_rules_table; print(cfg_rules_table())"
"""

from __future__ import annotations

from paradiff.plans.pipelines import BATCH, CFG_NOT_SPLIT, CFG_RULES, GUIDER_PIPELINES, NEVER_GUIDES


def cfg_rules_table() -> str:
    rows = ["| Pipeline | CFG style | Guides when | Batched transformer arguments |", "|---|---|---|---|"]
    for name, rule in sorted(CFG_RULES.items()):
        if rule.style == BATCH:
            style = f"one call on [{', '.join(rule.batch_order)}]"
            dims = dict(rule.batch_dims)
            batched = ", ".join(f"`{argument}`" + (" (one tensor per sample)" if argument in rule.sample_lists else "")
                                + (f" (batch on dimension {dims[argument]})" if argument in dims else "")
                                for argument in rule.batched)
        else:
            style, batched = "two calls", "-"
        when = f"`{rule.scale_argument}` > {rule.threshold:g} (default {rule.default_scale:g})"
        if rule.needs_negative_prompt:
            when += ", a negative prompt"
        if rule.truncation_argument:
            when += f", `{rule.truncation_argument}` = 1"
        if rule.disabled_by_config:
            when += f", not `{rule.disabled_by_config}`"
        rows.append(f"| `{name}` | {style} | {when} | {batched} |")
    for name in sorted(GUIDER_PIPELINES):
        rows.append(f"| `{name}` | its guider: one call per branch (2, or 3 with SkipLayerGuidance ...) | the guider "
                    "runs more than one branch | - |")
    for name in sorted(NEVER_GUIDES):
        rows.append(f"| `{name}` | never guides (guidance-distilled) | - | - |")
    for name in sorted(CFG_NOT_SPLIT):
        rows.append(f"| `{name}` | refused: {CFG_NOT_SPLIT[name]} | - | - |")
    return "\n".join(rows)
