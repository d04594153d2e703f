"""Know before launching: a dry run's parameter counts, per-rank memory by category, FLOPs and pipeline
bubble, and a layout planner that ranks every valid layout by predicted step time (docs/planning.md).

Everything here runs on the meta device: the model is built, traced and sized, never allocated. It sits
above the trainer (it reuses its config, rules and model building); nothing below imports it.
"""
