"""Model code paradiff ports from diffusers so that a model splits: a module per family (`models/<family>.py`) with
the forwards, processors and recurrences a plan in `plans/` names where diffusers' own would not split (they reshape
by the full width, or attend behind a mask the token split cannot follow). Only code: which module gets which is the
plan's to say. Sits below `plans/`, on the mechanisms (`context_parallel/`) it splits with."""
